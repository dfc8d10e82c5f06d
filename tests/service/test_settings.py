"""specserve.shared.process.settings: one declaration per setting -> flag, environment variable, default.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_settings.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specserve.shared.runtime.random_model import TINY_CONFIG, write_random_model

SPECSERVE = [sys.executable, "-m", "specserve.cli"]


# --- through the console script ---------------------------------------------------------------


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*SPECSERVE, *args], capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}, **env})


@pytest.mark.parametrize("command", ["gateway", "target", "up", "profile"])
def test_a_bad_draft_variable_leaves_other_subcommands_alone(command):
    proc = run(command, "--help", env={"SPECSERVE_DRAFT_PORT": "abc"})
    assert proc.returncode == 0, proc.stderr
    assert "usage: specserve" in proc.stdout and proc.stderr == ""


def test_a_bad_draft_variable_stops_the_draft_with_one_line(tmp_path):
    tiny = write_random_model(tmp_path / "tiny", TINY_CONFIG, seed=1, std=0.1)
    proc = run("draft", "--model", str(tiny), "--threads", "1", env={"SPECSERVE_DRAFT_PORT": "abc"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "error: SPECSERVE_DRAFT_PORT='abc' is not an integer\n"
    assert "ready" not in proc.stdout
