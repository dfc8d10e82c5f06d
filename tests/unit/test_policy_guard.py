"""bench/policy_guard.py: its mixes are new and scale with the preset, and its verdicts name what breaks
the bar (the default under the best other policy at a rate, or under the best FIFO policy at its 50 %
rate), on a hand-made sweep."""

from __future__ import annotations

import pytest

from specserve.cli.loadgen.workload import DEFAULT_MIX, parse_mix
from tests.support.sweeps import bench_module, hand_sweep


@pytest.fixture(scope="module")
def guard():
    return bench_module("policy_guard")


def _cell(guard, curves: dict) -> dict:
    results = hand_sweep(curves)
    return {"envelope": guard.paper_ratio.envelope(results, guard.DEFAULT),
            "cliff": guard.paper_ratio.ratios(results, [guard.DEFAULT], guard.FIFO_POLICIES)}


def test_the_mixes_scale_with_the_baseline_and_are_not_the_other_benches(guard):
    from admission import MIX as ADMISSION_MIX  # bench/admission.py

    for mix in guard.MIXES.values():
        ms = guard.mix_in_ms(mix, 50.0)
        cats = parse_mix(ms)
        assert sum(c.share for c in cats) == pytest.approx(1.0)
        assert [c.tpot_ms for c in cats] == pytest.approx([50.0 * float(p.split(":")[2]) for p in mix.split(",")])
        assert ms not in (DEFAULT_MIX, ADMISSION_MIX)
    assert guard.mix_in_ms("critical=0.5:short:1.5,chat=0.5:long:10", 40.0) == \
        "critical=0.5:short:60.0,chat=0.5:long:400.0"


def test_a_default_at_the_top_holds(guard):
    cell = _cell(guard, {
        "joint@slo": [(0.95, 95.0), (0.9, 180.0), (0.8, 240.0)],
        "slo-goodput@slo": [(0.95, 95.0), (0.88, 176.0), (0.7, 210.0)],
        "chain:3": [(0.9, 90.0), (0.6, 120.0), (0.4, 120.0)],  # 50 % at 2.5 req/s
        "none": [(0.6, 60.0), (0.4, 80.0), (0.2, 60.0)],
    })
    assert guard.verdicts(cell, 0.98, 1.5) == []
    assert cell["cliff"]["best_baseline"] == "chain:3" and cell["cliff"]["rate"] == pytest.approx(2.5)
    assert "holds" in guard.summary({"7b, agents": cell}, 0.98, 1.5)


def test_a_default_that_trails_is_named_with_the_rate_and_the_winner(guard):
    cell = _cell(guard, {
        "joint@slo": [(0.95, 95.0), (0.6, 120.0), (0.5, 150.0)],
        "chain:5@slo": [(0.95, 95.0), (0.7, 140.0), (0.45, 135.0)],
        "nightjar": [(0.9, 90.0), (0.6, 120.0), (0.4, 120.0)],  # 50 % at 2.5 req/s, the default 0.55 there
    })
    broken = guard.verdicts(cell, 0.98, 1.5)
    assert "attainment at 2 req/s: 0.86x chain:5@slo" in broken
    assert "goodput at 2 req/s: 0.86x chain:5@slo" in broken
    assert any(b.startswith("cliff attainment: 1.10x nightjar at 2.5 req/s") for b in broken)
    assert not any("at 1 req/s" in b or "at 3 req/s" in b for b in broken if not b.startswith("cliff"))


def test_the_breakdown_counts_each_tiers_fate(guard, tmp_path):
    from specserve.cli.loadgen.records import RequestRecord

    def rec(i, tier, **kw):
        return RequestRecord(index=i, category=tier, workload="short", prompt_id=str(i), slo_tpot_ms=50.0,
                             slo_ttft_ms=1000.0, scheduled_s=0.0, sent_s=0.0, max_tokens=8, **kw)

    served = {"status": 200, "ttft_ms": 100.0, "tpot_ms": 40.0, "steps": 4, "step_tokens": 8}
    records = [rec(0, "critical", **served), rec(1, "critical", status=503),
               rec(2, "critical", **(served | {"tpot_ms": 60.0, "steps": 8})),
               rec(3, "chat", **(served | {"ttft_ms": 2000.0, "best_effort": True}))]
    (tmp_path / "joint@slo-rate2-run0.jsonl").write_bytes(
        b"\n".join(guard.msgspec.json.encode(r) for r in records) + b"\n")
    got = guard.why(tmp_path, ["joint@slo"], 2.0, 1)["joint@slo"]
    assert got["critical"] == {"requests": 3, "refused": 1, "best_effort": 0, "ttft_missed": 0, "tpot_missed": 1,
                               "met": 1, "tokens_per_step": 1.33}
    assert got["chat"] == {"requests": 1, "refused": 0, "best_effort": 1, "ttft_missed": 1, "tpot_missed": 0,
                           "met": 0, "tokens_per_step": 2.0}
    assert "| joint@slo | 1, 0, 1, 1, 0, **0**, 2.0 | 3, 1, 0, 0, 1, **1**, 1.33 |" in guard.why_markdown(2.0, {
        "joint@slo": got})
