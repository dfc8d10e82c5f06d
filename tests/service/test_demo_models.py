"""The bundled demo pair (models/) through our runtime: tokenizer, transformers parity, held-out split.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_demo_models.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_tracked_tree_fits_what_a_gpu_machine_is_sent():
    """The device tool sends the working tree (tracked files) to a lent GPU, 64 MiB at most with the wheels the
    run carries (bench/gpu_suite.py): the tracked files keep 18 MiB of it free. The budget is the tree as
    measured (45.5 MiB, models/smollm2-draft stored as int8 rows, large results as .json.xz) rounded up to
    the next 2 MiB: what grows the tree past it is a choice to make, not a drift."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in listed.decode().split("\0") if name]
    # lstat: a tracked link (models/draft's tokenizer files) is sent as a link, not as the file it names.
    total = sum(f.lstat().st_size for f in files if f.is_symlink() or f.is_file())
    assert total <= 48 * 2**20, f"tracked files take {total / 2**20:.1f} MiB, over the 48 MiB budget"
