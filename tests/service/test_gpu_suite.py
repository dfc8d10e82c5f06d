"""bench/gpu_suite.py, the prepared GPU run, end to end on CPU (`--dry-run`: tiny shapes, Triton's interpreter,
the stack on the CPU), so that the one call a lent GPU gets does not fail on rot."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_the_gpu_suite_runs_every_section_dry_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--dry-run", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    text = (tmp_path / "gpu_suite.json").read_text()
    assert str(ROOT) not in text  # the report carries no path of this machine's checkout
    report = json.loads(text)
    sections = report["sections"]
    assert list(sections) == ["parity", "bits", "curves", "ipc", "offload", "stack", "overhead", "sim"]
    assert not [name for name, s in sections.items() if "error" in s]
    assert report["dry_run"] and report["environment"]["triton_interpret"]
    parity = sections["parity"]["result"]
    assert {(r["attention"], r["graphs"]) for r in parity} == {("sdpa", "no"), ("triton", "no"),
                                                               ("triton", "padded, eager")}
    assert {r["dtype"] for r in parity} == {"float32", "bfloat16"}
    assert all(r["greedy_equal"] and r["max_abs_logit_diff"] < 1e-3 for r in parity if r["dtype"] == "float32")
    assert [(r["shape"], r["tiles_equal"], r["chain_equals_decoded"]) for r in sections["bits"]["result"]] == [
        ("tiny", True, True)]
    assert sections["bits"]["result"][0]["max_abs_diff_vs_reference"] < 1e-4
    rows = sections["curves"]["result"]["tiny"]
    assert {r["kind"] for r in rows} == {"decode", "tree", "context"}
    assert all(r[m] > 0 for r in rows for m in ("sdpa", "triton", "graphs"))
    assert all(r["triton_tile1"] > 0 for r in rows if r["kind"] == "tree")  # the kernel untiled, beside it
    assert [r["path"] for r in sections["ipc"]["result"]] == ["socket", "cuda_ipc"]  # CUDA IPC: skipped on CPU
    assert {(r["prompt"], r["dtype"]) for r in parity} == {(k, d) for k in ("random", "text")
                                                          for d in ("float32", "bfloat16")}
    assert [r["draft"] for r in sections["offload"]["result"]] == ["draft", "smollm2-draft"]
    assert all(r["weights_mb"] > 1 and r["reload_ms"] > 0 for r in sections["offload"]["result"])
    stack = sections["stack"]["result"]
    assert all(n == stack["lossless_of"] for n in stack["lossless"].values())  # every policy: none's texts
    assert {(r["policy"], r["concurrency"]) for r in stack["runs"]} == {
        (p, c) for p in ("joint", "none", "chain:4", "none@fifo") for c in (1, 2)}
    assert stack["profile"]["baseline_iteration_ms"] > 0 and stack["classes"]["none@fifo"]["classes"]["chat"]
    assert not any(r["admission"] for r in stack["runs"] if r["policy"] == "none@fifo")  # FIFO: never declines
    assert all(r["iteration_ms"] > 0 and r["iteration_ms_by_part"]["target"] > 0 for r in stack["runs"])
    assert all(r["errors"] == 0 and r["tokens_per_s"] > 0 for r in stack["runs"])
    overhead = sections["overhead"]["result"]
    assert list(overhead) == ["none@1", "none+ahead@1", "none@2", "none+ahead@2", "joint@2", "joint+ahead@2",
                              "none-loose@2", "joint-loose@2"]
    assert all(r["iterations"] > 0 and r["target_ms"] > 0 and r["tokens_per_s"] > 0 for r in overhead.values())
    assert all(r["stack_ms"] == pytest.approx(r["iteration_ms"] - r["target_ms"]) for r in overhead.values())
    sim = sections["sim"]["result"]
    preset = tomllib.loads(sim["preset"])
    assert preset["target"]["padded_attention"] is False and len(preset["target"]["tokens"]) >= 2
    assert set(sim["error_vs_real"]) == {"tokens_per_s", "ttft_p50_ms", "tpot_p50_ms", "tokens_per_step"}
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "DRY RUN" in md and "## Parity with transformers" in md and "## Simulator" in md
    assert "## The stack's own time" in md
