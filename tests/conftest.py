"""Suite-wide settings."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def single_intra_op_thread():
    """The test models are tiny: one intra-op thread is fastest, and immune to OpenMP workers
    spinning against other processes on a 2-core machine (that made modules 6-20x slower).
    Subprocesses started by tests (the CLI, services) keep their own settings."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
