"""Suite-wide settings."""

from __future__ import annotations

import os
import secrets

import pytest
import torch

# One shared secret for the whole run (shared/auth.py), set before anything starts: every test, the
# services and gateways it starts (they inherit the environment) and its clients use it.
os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))


@pytest.fixture(autouse=True, scope="session")
def single_intra_op_thread():
    """The test models are tiny: one intra-op thread is fastest, and immune to OpenMP workers
    spinning against other processes on a 2-core machine (that made modules 6-20x slower).
    Subprocesses started by tests (the CLI, services) keep their own settings."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`specserve up` for a test module: it profiles on first start into a fresh file, then B is pinned
    to 24 so the tests do not depend on this machine's timing. (test_gateway.py has its own.)"""
    from tests.gateway_procs import Up

    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    server = Up("--profile", str(profile), "--", "--budget", "24")
    yield server
    server.interrupt()


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """transformers' greedy output of the target alone on test_gateway.PROMPTS."""
    from tests.test_gateway import transformers_greedy

    return transformers_greedy()
