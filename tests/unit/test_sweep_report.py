"""bench/sweep.py's reporting: medians over runs, the generated docs section, the figures.

The sweep itself takes minutes (it is a benchmark, run by hand); here its report is built from a
small hand-made sweep.json-shaped dict whose medians are known.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "bench" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(att: float, goodput: float, crit: float, mean_ms: float) -> dict:
    share = {"draft": 0.25, "target": 0.6, "transport": 0.1, "schedule": 0.05}
    return {"attainment": att, "goodput_tok_s": goodput, "throughput_tok_s": goodput * 2, "ttft_p50_ms": 50.0,
            "ttft_p99_ms": 90.0, "tpot_p50_ms": 12.0, "tokens_per_step": 1.5, "acceptance_rate": 0.5,
            "iteration": {"mean_ms": mean_ms, "share": share},
            "categories": {"critical": {"attainment": crit}, "search": {"attainment": 1.0},
                           "chat": {"attainment": 1.0}}}


def _results(name: str = "full") -> dict:
    policies = ["none", "adaserve"]
    points = []
    for p, base in (("none", 0.5), ("adaserve", 0.7)):
        for rate in (0.5, 2.0):
            for run, delta in enumerate((0.0, 0.3, 0.1)):  # median base - load + 0.1, mean + 0.133
                att = base - (0.3 if rate == 2.0 else 0.0) + delta
                points.append({"policy": p, "rate": rate, "run": run,
                               "summary": _summary(att, 100 * att, att / 2, 20.0 + run)})
    solo = [{"policy": p, "run": 0, "summary": _summary(1.0, 60.0, 1.0, 15.0)} for p in policies]
    return {
        "meta": {"mode": "full", "name": name, "date": "2026-11-23T00:00:00+00:00", "commit": "abc1234",
                 "cpu": "test cpu", "cores": 2, "python": "3.11", "torch": "2.13.0", "transformers": "5",
                 "wall_s": 60.0},
        "settings": {"rates": [0.5, 2.0], "duration_s": 8.0, "min_requests": 5, "runs": 3, "chain_ks": [4],
                     "solo_requests": 8, "seed": 0, "mix": "critical=0.6:short", "calibration_rate": 1.0,
                     "threads": 1, "gateway_args": [], "solo": {"max_tokens": 64, "mix": "critical=1:short"}},
        "profile": {"budget_tokens": 16, "baseline_iteration_ms": 15.0},
        "classes": {"critical": {"tpot_ms": 15.0}, "search": {"tpot_ms": 36.0}, "chat": {"tpot_ms": 120.0}},
        "chain_calibration": {}, "chain_k": 4, "policies": policies, "points": points, "solo": solo,
        "hf_peer": None,
    }


def test_medians_over_runs(sweep):
    t = sweep.table(_results())
    agg = t["adaserve"][2.0]["attainment"]
    assert agg["median"] == pytest.approx(0.5) and agg["min"] == pytest.approx(0.4)
    assert agg["max"] == pytest.approx(0.7) and agg["n"] == 3
    assert t["none"][0.5]["categories.critical.attainment"]["median"] == pytest.approx(0.3)
    assert t["none"][0.5]["iteration.share.draft"]["median"] == pytest.approx(0.25)
    assert t["none"][0.5]["iteration.mean_ms"]["median"] == pytest.approx(21.0)


def test_markdown_tables(sweep, tmp_path):
    text = sweep.markdown(_results(), tmp_path / "figures", tmp_path / "benchmarks.md")
    # Attainment table row: medians in %, min-max in brackets.
    assert "| adaserve | 80 (70-100) | 50 (40-70) |" in text
    assert "| none | 60 (50-80) | 30 (20-50) |" in text
    assert "B = 16 tokens per pass" in text and "critical 15.0 ms" in text
    assert "abc1234" not in text  # the commit stays in the results' meta, not in the docs
    assert "![attainment](figures/sweep-full-attainment.png)" in text
    assert "SIMULATED" not in text


def test_a_simulated_sweep_is_labelled_so(sweep, tmp_path):
    results = _results("sim")
    results["meta"]["simulated"] = "llama2-7b-a100,time_scale=4"
    text = sweep.markdown(results, tmp_path / "figures", tmp_path / "benchmarks.md")
    assert text.startswith("**SIMULATED** (`--simulate llama2-7b-a100,time_scale=4`)")
    assert "--simulate 'llama2-7b-a100,time_scale=4'" in text


def test_write_docs_replaces_only_its_section(sweep, tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nhand-written text\n")
    sweep.write_docs(_results(), docs, tmp_path / "figures")
    once = docs.read_text()
    assert once.startswith("# Benchmarks\n\nhand-written text\n")
    assert once.count("<!-- sweep:full:begin -->") == 1
    docs.write_text(once + "\nafter the section\n")
    sweep.write_docs(_results(), docs, tmp_path / "figures")
    twice = docs.read_text()
    assert twice == once + "\nafter the section\n"  # replaced in place, the text around it kept
    sweep.write_docs(_results("other"), docs, tmp_path / "figures")
    assert docs.read_text().count("<!-- sweep:") == 4  # a second named sweep gets its own section


def test_figures_are_pngs(sweep, tmp_path):
    paths = sweep.plot(_results(), tmp_path, "sweep-full")
    assert [p.name for p in paths] == ["sweep-full-attainment.png", "sweep-full-goodput.png",
                                       "sweep-full-attainment-per-category.png", "sweep-full-iteration-split.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_docs_file_per_kind(sweep):
    real, sim = _results(), _results("sim")
    sim["meta"]["simulated"] = "llama2-7b-a100,time_scale=4"
    assert sweep.default_docs(real).parts[-2:] == ("lab", "sweep.md")
    assert sweep.default_docs(sim).parts[-2:] == ("lab", "sweep_sim.md")
    for path in (sweep.default_docs(real), sweep.default_docs(sim)):  # the generated sections live there
        assert "<!-- sweep:" in path.read_text()


def test_a_policy_carries_its_admission_and_its_own_flags(sweep):
    assert sweep.policy_args("chain:4", []) == ["--policy", "chain:4", "--admission", "fifo"]
    assert sweep.policy_args("joint@slo --max-width 1", []) == ["--policy", "joint", "--admission", "slo",
                                                                 "--max-width", "1"]
    assert sweep.policy_args("joint --max-width 1", ["--admission", "slo"]) == ["--policy", "joint", "--max-width", "1"]
    assert sweep.slug("joint@slo --max-width 1") == "joint@slo--max-width1"


def test_a_result_reads_the_same_plain_or_compressed(sweep, tmp_path):
    import json
    import lzma

    plain, packed = tmp_path / "sweep.json", tmp_path / "sweep.json.xz"
    plain.write_text(json.dumps(_results()))
    packed.write_bytes(lzma.compress(plain.read_bytes()))
    assert sweep.load_result(plain) == sweep.load_result(str(packed)) == _results()


def test_every_compressed_result_reads(sweep):
    packed = sorted((ROOT / "bench" / "results").rglob("*.json.xz"))
    assert len(packed) >= 40  # the large results are stored so (docs/architecture.md)
    for path in packed:
        assert isinstance(sweep.load_result(path), dict), path


def test_replot_redoes_the_figures_from_a_compressed_sweep(sweep, tmp_path, capsys):
    stored = ROOT / "bench" / "results" / "sweep-full" / "sweep.json.xz"
    assert sweep.main(["--replot", str(stored), "--fig-dir", str(tmp_path), "--docs", ""]) == 0
    assert sorted(p.name for p in tmp_path.iterdir())[0] == "sweep-full-attainment-per-category.png"
    assert "Generated by `bench/sweep.py`" in capsys.readouterr().out
