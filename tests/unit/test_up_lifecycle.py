"""`specserve up` owns its children, and a taken port is reported as exactly that.

`up` killed with SIGKILL (no chance to stop anything) must take the gateway, draft and target with
it within seconds, so that a new `up` on the same port starts. A port that is already taken stops
`up`, the gateway and both services at once with "port N is already in use", exit status 1.

The draft and target listen on Unix sockets in a private directory that `up` removes when it stops
(the services remove their own sockets, so even a killed `up` leaves no socket file);
`--tcp-services` puts them on loopback TCP ports instead, and both serve the API. Either way each
service serves Prometheus /metrics on a port of its own, printed as `metrics <name> <url>`.

Here: the tests that start no process and open no socket; the others are in
tests/service/test_up_lifecycle.py and tests/stack/test_up_lifecycle.py.
"""

from __future__ import annotations

import os
import threading

import pytest

from specserve.shared.process.lifeline import DEATH_SIGNAL_VAR, PARENT_PID_VAR, child_environment, follow_parent


def test_the_lifeline_is_armed_only_by_its_variable():
    assert follow_parent(environ={}) is None  # a service started by hand: nothing set up
    env = child_environment({"OTHER": "1", DEATH_SIGNAL_VAR: "1"})
    assert env[PARENT_PID_VAR] == str(os.getpid()) and env[DEATH_SIGNAL_VAR] == "1" and env["OTHER"] == "1"
    from_thread: list[dict[str, str]] = []
    worker = threading.Thread(target=lambda: from_thread.append(child_environment({DEATH_SIGNAL_VAR: "1"})))
    worker.start()
    worker.join()
    assert DEATH_SIGNAL_VAR not in from_thread[0]  # Linux would signal when that thread ends
    # A parent that is already gone when the child starts: it stops at once, and the variable is consumed.
    gone = {PARENT_PID_VAR: str(os.getppid() + 1_000_000)}
    with pytest.raises(SystemExit):
        follow_parent(environ=gone)
    assert PARENT_PID_VAR not in gone
