"""Strangers cannot drive the services: the shared-secret handshake and the server-side timeouts.

Against real draft and target processes (short timeouts through their SPECSERVE_<SERVICE>_*
variables): a connection that has not proved the secret gets answers to Health only; Release,
Offload, Speculate, Forward and Stats are refused and, after a few tries or one wrong proof, the
connection is closed, while an authenticated client's Stats show that nothing changed. Half-sent
frames and idle unauthenticated connections are dropped; idle authenticated ones stay. The suite's
secret comes from tests/conftest.py.

Here: the tests that start no process and open no socket; the others are in tests/service/test_auth.py.
"""

from __future__ import annotations

import time

import pytest

from specserve.shared.process.settings import SettingsError
from specserve.shared.wire.auth import load_secret


def test_the_secret_comes_from_the_argument_then_the_file_then_the_variable(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  from-the-file-0123456789\n")
    both = {"SPECSERVE_SECRET_FILE": str(path), "SPECSERVE_SECRET": "from-the-variable-0123"}
    assert load_secret("from-the-argument-0123", environ=both) == b"from-the-argument-0123"
    assert load_secret(environ=both) == b"from-the-file-0123456789"
    assert load_secret(environ={"SPECSERVE_SECRET": "from-the-variable-0123"}) == b"from-the-variable-0123"
    with pytest.raises(SettingsError, match="no shared secret"):
        load_secret(environ={})
    with pytest.raises(SettingsError, match="cannot read the secret file"):
        load_secret(environ={"SPECSERVE_SECRET_FILE": str(tmp_path / "missing")})
    with pytest.raises(SettingsError, match="at least 16 characters"):
        load_secret(environ={"SPECSERVE_SECRET": "short"})


def test_services_started_side_by_side_share_one_new_secret():
    # bench/sweep.py starts its target(s) and draft from threads; each ServiceProcess calls
    # ensure_secret, and two that both found none once made two secrets (a gateway then could not
    # authenticate to a target: "the service does not hold our shared secret")
    import threading

    from specserve.shared.wire.auth import SECRET_VAR, ensure_secret

    class Slow(dict):  # an environment whose lookups yield the GIL, as a busy machine does
        writes = 0

        def get(self, key, default=None):
            value = super().get(key, default)
            time.sleep(0.01)  # the others look now, before this thread acts on what it saw
            return value

        def __setitem__(self, key, value):
            Slow.writes += 1  # each write is a secret some child may have been started with
            super().__setitem__(key, value)

    env = Slow()
    workers = [threading.Thread(target=ensure_secret, args=(env,)) for _ in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert Slow.writes == 1 and SECRET_VAR in env
