"""The `specserve` console script, run as a real process.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_cli.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.shared.runtime.random_model import TINY_CONFIG, write_random_model

SPECSERVE = [sys.executable, "-m", "specserve.cli"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("cli") / "tiny", TINY_CONFIG, seed=1, std=0.1)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SPECSERVE, *args], capture_output=True, text=True, timeout=120)


def test_console_script_is_installed():
    exe = shutil.which("specserve", path=str(Path(sys.executable).parent))
    assert exe, "the specserve console script is missing from the environment"
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "smoke" in proc.stdout


def test_smoke_generates(tiny_dir):
    proc = run("smoke", "--model", str(tiny_dir), "--max-tokens", "6", "--num-blocks", "32")
    assert proc.returncode == 0, proc.stderr
    assert "output (6 tokens)" in proc.stdout
    assert "KV blocks free after release: 32/32" in proc.stdout


def test_smoke_defaults_to_the_bundled_target():
    proc = run("smoke", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "models/target (LlamaForCausalLM" in proc.stdout
    assert "KV blocks free after release: 256/256" in proc.stdout


def test_smoke_reports_missing_model_dir(tmp_path):
    proc = run("smoke", "--model", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert "model directory not found" in proc.stderr


def test_smoke_reports_unsupported_architecture(tiny_dir, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = run("smoke", "--model", str(bad))
    assert proc.returncode == 2
    assert "unsupported architecture 'GPT2LMHeadModel'" in proc.stderr


@pytest.mark.parametrize("service", ["draft", "target"])
def test_services_report_a_bad_model_dir_and_exit_2(service, tmp_path):
    proc = run(service, "--model", str(tmp_path / "nowhere"), "--port", "0", "--threads", "1")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "nowhere" in proc.stderr
    assert "Traceback" not in proc.stderr and "ready" not in proc.stdout


def test_models_lists_the_named_models_and_refuses_an_unknown_one(tmp_path):
    env = {**os.environ, "SPECSERVE_MODELS_DIR": str(tmp_path)}
    listed = subprocess.run([*SPECSERVE, "models", "list"], capture_output=True, text=True, timeout=120, env=env)
    assert listed.returncode == 0 and "smollm2-135m-instruct\tnot installed" in listed.stdout, listed
    assert "draft by default: " in listed.stdout, listed
    unknown = subprocess.run([*SPECSERVE, "models", "install", "no-such-model"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert unknown.returncode == 1 and unknown.stderr.startswith("error: unknown model name 'no-such-model'"), unknown
    assert not list(tmp_path.iterdir())  # nothing half made



@pytest.mark.parametrize(("args", "message"), [
    (["--metrics-port", "65535", "--targets", "2"], "--metrics-port 65535: the ports 65535-65537 are not all valid"),
    (["--port", "9102", "--metrics-port", "9101"],
     "--metrics-port 9101: the services' /metrics ports 9101-9102 include the gateway's --port 9102"),
])
def test_up_refuses_metrics_ports_it_cannot_use(args, message):
    proc = run("up", *args)
    assert proc.returncode == 2 and f"error: {message}" in proc.stderr, proc.stderr
    assert "starting" not in proc.stderr
