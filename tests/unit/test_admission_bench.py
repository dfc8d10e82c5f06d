"""bench/admission.py's own logic, no processes: how a request's end is classified, the capacity
search, the queue's drain after a burst, and the docs section replaced in place."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import admission  # noqa: E402

from specserve.cli.loadgen.records import RequestRecord  # noqa: E402


def _rec(**kw) -> RequestRecord:
    base = dict(index=0, category="critical", workload="short", prompt_id="p", slo_tpot_ms=20.0, slo_ttft_ms=1000.0,
                scheduled_s=0.0, sent_s=0.0, max_tokens=8)
    return RequestRecord(**(base | kw))


def test_every_request_has_exactly_one_outcome():
    served = dict(status=200, finish_reason="length", ttft_ms=100.0, latency_ms=500.0, completion_tokens=8)
    cases = [
        (_rec(**served, tpot_ms=15.0), "slo_met"),
        (_rec(**served, tpot_ms=25.0), "slo_missed"),  # TPOT over its SLO
        (_rec(**(served | {"ttft_ms": 1500.0}), tpot_ms=15.0), "slo_missed"),  # TTFT over its SLO
        (_rec(**served, tpot_ms=99.0, best_effort=True), "best_effort"),  # no SLO applied
        (_rec(status=503, error="no replica", retry_after_s=2.0, status_ms=4.0), "refused"),
        (_rec(status=503, error="queue full"), "failed"),  # a 503 without Retry-After is not a clean refusal
        (_rec(status=0, error="TimeoutError: "), "failed"),
        (_rec(status=200, error="the stream ended without a finish_reason"), "failed"),
    ]
    for record, expected in cases:
        assert admission.outcome(record) == expected, (record, expected)
    acc = admission.account([r for r, _ in cases])
    assert acc["outcomes"] == {"slo_met": 1, "slo_missed": 2, "best_effort": 1, "refused": 1, "failed": 3}
    assert sum(acc["outcomes"].values()) == len(cases)
    assert acc["refused_status_ms_max"] == 4.0 and acc["retry_after_s"] == [2.0]


def _search(capacity: float, **kw):
    tried: list[float] = []

    def attains(rate: float) -> bool:
        tried.append(rate)
        return rate <= capacity

    args = dict(start=1.0, step=2.0, fine=3, min_rate=0.01, max_rate=1000.0, budget_s=1e9) | kw
    return admission.search_capacity(attains, **args), tried


def test_capacity_search_brackets_the_true_capacity():
    (passed, failed), tried = _search(5.0)
    assert tried[:4] == [1.0, 2.0, 4.0, 8.0]  # coarse: up to the first miss
    assert tried[4:] == [6.0, 5.0, 5.5]  # fine: bisection between 4 and 8
    assert (passed, failed) == (5.0, 5.5)
    for capacity in (0.3, 1.0, 3.7, 40.0):
        (passed, failed), _ = _search(capacity, fine=6)
        assert passed <= capacity < failed and failed - passed <= max(capacity, 1.0) / 2 ** 5
    (passed, failed), tried = _search(0.3, fine=0)  # the start already misses: downwards to a pass
    assert tried == [1.0, 0.5, 0.25] and (passed, failed) == (0.25, 0.5)
    assert _search(0.001, fine=0)[0] == (None, 0.015625)  # nothing passes above min_rate
    assert _search(1e6, fine=2)[0] == (512.0, None)  # max_rate reached without a miss


def test_capacity_search_stops_at_its_time_budget():
    ticks = iter(range(100))
    (passed, failed), tried = _search(100.0, budget_s=3, clock=lambda: next(ticks))
    assert tried == [1.0, 2.0] and (passed, failed) == (2.0, None)


def test_drain_after_a_burst():
    # (t, waiting, running): up to 2 running before the burst (10-20 s); the queue builds, then drains
    queue = [[t, 0, 1 + t % 2] for t in range(10)]
    queue += [[10 + t, t, 4] for t in range(10)]
    queue += [[20, 6, 4], [21, 3, 4], [22, 0, 4], [23, 0, 3], [24, 0, 2], [25, 0, 1]]
    d = admission.drain(queue, 10.0, 20.0)
    assert d == {"peak_waiting": 9, "peak_running": 4, "running_before_max": 2, "waiting_empty_after_s": 2,
                 "settled_after_s": 4}
    assert admission.drain([[0, 0, 1], [11, 5, 3], [21, 1, 3]], 10.0, 20.0)["waiting_empty_after_s"] is None


def test_docs_section_replaced_in_place(tmp_path):
    docs = tmp_path / "b.md"
    docs.write_text("# Benchmarks\n\nintro\n")
    admission.write_docs(docs, "first")
    assert docs.read_text().startswith("# Benchmarks\n\nintro\n") and "first" in docs.read_text()
    docs.write_text(docs.read_text() + "\n## after\n")
    admission.write_docs(docs, "second")
    text = docs.read_text()
    assert "second" in text and "first" not in text and text.endswith("## after\n") and text.count(admission.BEGIN) == 1


@pytest.mark.parametrize("argv, message", [
    (["capacity", "--admission", "slo", "--start-rate", "0"], "--start-rate must be a positive number"),
    (["overload", "--runs", "0"], "--runs must be >= 1"),
    (["capacity", "--admission", "lifo", "--start-rate", "1"], "invalid choice"),
])
def test_bad_flags_exit_2_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        admission.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
