"""bench/paper_ratio.py: AdaServe's headline ratio (a policy over the best baseline at the rate where
that baseline falls to 50 % attainment), on a hand-made sweep whose answer is computed by hand."""

from __future__ import annotations

import pytest

from tests.support.sweeps import bench_module, hand_sweep


@pytest.fixture(scope="module")
def paper_ratio():
    return bench_module("paper_ratio")


def test_the_ratio_is_taken_where_the_last_baseline_falls_to_half(paper_ratio):
    r = paper_ratio.ratios(hand_sweep({
        "none": [(0.6, 60.0), (0.4, 40.0), (0.2, 20.0)],  # 50 % at 1.5 req/s
        "chain:4": [(0.9, 90.0), (0.7, 70.0), (0.3, 30.0)],  # 50 % at 2.5 req/s: the best baseline
        "adaserve": [(1.0, 100.0), (0.9, 180.0), (0.7, 140.0)],
    }))
    assert r["best_baseline"] == "chain:4" and r["rate"] == pytest.approx(2.5) and r["flag"] == ""
    assert r["baseline_attainment"] == pytest.approx(0.5) and r["baseline_goodput"] == pytest.approx(50.0)
    ada = r["policies"]["adaserve"]
    assert ada["attainment"] == pytest.approx(0.8) and ada["attainment_ratio"] == pytest.approx(1.6)
    assert ada["goodput"] == pytest.approx(160.0) and ada["goodput_ratio"] == pytest.approx(3.2)
    assert ada["up_to_attainment"] == pytest.approx(0.7 / 0.3) and ada["up_to_goodput"] == pytest.approx(140 / 30)
    assert "| adaserve | 80 % | 1.60x | 160 | 3.20x |" in paper_ratio.markdown(r)


def test_a_baseline_below_half_everywhere_is_flagged(paper_ratio):
    r = paper_ratio.ratios(hand_sweep({"none": [(0.4, 40.0), (0.3, 30.0), (0.1, 10.0)],
                                   "adaserve": [(0.8, 80.0), (0.6, 60.0), (0.4, 40.0)]}))
    assert r["rate"] == 1.0 and r["flag"] == "below"
    assert r["policies"]["adaserve"]["attainment_ratio"] == pytest.approx(2.0)
    assert "below 50 % already" in paper_ratio.markdown(r)


def test_two_sweeps_merge_into_one_rate_axis(paper_ratio):
    low = hand_sweep({"none": [(0.9, 9.0), (0.8, 16.0)], "adaserve": [(1.0, 10.0), (0.9, 18.0)]}, rates=(1.0, 2.0))
    high = hand_sweep({"none": [(0.3, 12.0)], "adaserve": [(0.6, 24.0)]}, rates=(4.0,))
    r = paper_ratio.ratios(paper_ratio.merged([low, high]))
    assert r["rates"] == [1.0, 2.0, 4.0] and r["rate"] == pytest.approx(2.0 + 2.0 * 0.3 / 0.5)
    with pytest.raises(SystemExit, match="cannot be merged"):
        paper_ratio.merged([low, hand_sweep({"none": [(0.3, 12.0)]}, rates=(4.0,))])


def test_the_envelope_divides_by_the_best_other_policy_per_metric_and_rate(paper_ratio):
    rows = paper_ratio.envelope(hand_sweep({
        "none": [(0.6, 60.0), (0.4, 90.0), (0.2, 20.0)],
        "chain:4": [(0.9, 90.0), (0.7, 70.0), (0.3, 30.0)],
        "joint": [(0.9, 100.0), (0.35, 45.0), (0.3, 33.0)],
    }), "joint")
    assert [r["attainment"]["best"] for r in rows] == ["chain:4", "chain:4", "chain:4"]
    assert [r["goodput"]["best"] for r in rows] == ["chain:4", "none", "chain:4"]  # each metric on its own
    assert [r["attainment"]["ratio"] for r in rows] == pytest.approx([1.0, 0.5, 1.0])
    assert [r["goodput"]["ratio"] for r in rows] == pytest.approx([100 / 90, 0.5, 1.1])
    assert "| 2 | 35 (35-35) | chain:4 70 (70-70) | 0.50x | 45 (45-45) | none 90 (90-90) | 0.50x |" in \
        paper_ratio.envelope_markdown("joint", rows)
