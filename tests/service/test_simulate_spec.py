"""A bad or missing simulation spec exits 2 with one line (`--simulate ''` means no simulation, as for
every optional setting: shared/process/settings.py). The simulated stack itself is served and tested in
tests/stack/test_gateway.py (its `stack` fixture runs the gateway's shared tests against it)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("command,spec,words", [
    (["target"], "no-such-preset", "unknown preset"),
    (["draft"], "missing.toml", "no such preset file"),
    (["up", "--port", "0"], "bad/missing.toml", "no such preset file"),
])
def test_bad_or_missing_spec_exits_2_with_one_line(command, spec, words):
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", *command, "--simulate", spec],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
