"""bench/soak_rules.py: the soak's rules on hand-made records and samples (no stack here; the soak itself
runs in tests/stack/test_soak.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import soak  # noqa: E402
import soak_rules as rules  # noqa: E402

from specserve.cli.loadgen.records import RequestRecord  # noqa: E402


def rec(index: int, sent: float, **kw) -> RequestRecord:
    return RequestRecord(index=index, category="critical", workload="short", prompt_id="p", slo_tpot_ms=50.0,
                         slo_ttft_ms=1000.0, scheduled_s=sent, sent_s=sent, max_tokens=8, **kw)


def row(r: RequestRecord, end: float, frontend: int | None = None, source: str = "load") -> SimpleNamespace:
    return SimpleNamespace(record=r, end_s=end, frontend=frontend, source=source)


KILL_TARGET = {"name": "kill-target", "kind": "kill-target", "t": 10.0, "pid": 1}
KILL_FRONTEND = {"name": "kill-frontend", "kind": "kill-frontend", "t": 20.0, "pid": 77}


def test_only_what_a_fault_owns_may_fail():
    sent = [
        row(rec(0, 1.0, status=200), 5.0),  # completed
        row(rec(1, 2.0, status=503, retry_after_s=1.0, error="busy"), 2.1),  # refused: not lost
        row(rec(2, 9.0, status=200, error="the target service failed: connection lost"), 11.0),  # owned
        row(rec(3, 12.0, status=200, error="the target service failed: connection lost"), 13.0),  # after: lost
        row(rec(4, 19.0, status=200, error="ClientPayloadError: cut"), 21.0, frontend=77),  # its front end: owned
        row(rec(5, 19.0, status=200, error="ClientPayloadError: cut"), 21.0, frontend=78),  # the other one: lost
        row(rec(6, 19.9, error="ServerDisconnectedError: gone"), 20.1),  # accepted by the dying one: owned
        row(rec(7, 2.0, status=503, error="busy"), 2.1),  # a 503 without Retry-After: lost
        row(rec(8, 3.0, status=200, error="the target service failed: x"), 4.0),  # no kill then: lost
    ]
    acc = rules.account(sent, [KILL_TARGET, KILL_FRONTEND])
    assert (acc["requests"], acc["completed"], acc["refused"]) == (9, 1, 1)
    assert acc["owned"] == {"kill-target": 1, "kill-frontend": 2}
    assert sorted(x["index"] for x in acc["lost"]) == [3, 5, 7, 8]


def test_rss_slope_ignores_a_single_step_and_catches_a_steady_climb():
    def samples(rss_at) -> list[dict]:
        return [{"t": float(t), "procs": {"gateway": {"pid": 5, "anon_mb": rss_at(t)}}} for t in range(0, 3600, 30)]

    flat_with_step = rules.rss_growth(samples(lambda t: 300.0 + (6.0 if t > 900 else 0.0)), 600.0, 600.0)
    leak = rules.rss_growth(samples(lambda t: 300.0 + t / 600 * 3.0), 600.0, 600.0)  # 3 MB per 10 minutes
    assert abs(flat_with_step[0]["mb_per_10min"]) < 0.01
    assert abs(leak[0]["mb_per_10min"] - 3.0) < 1e-6


def test_a_restarted_process_is_judged_from_its_own_warm_up_when_the_run_leaves_time():
    snaps = []
    for t in range(0, 1200, 30):
        procs = {"draft": {"pid": 1 if t < 300 else 2, "anon_mb": 400.0 + (t / 60 if t >= 300 else 0.0)}}
        snaps.append({"t": float(t), "procs": procs})
    by_pid = {g["pid"]: g for g in rules.rss_growth(snaps, 100.0, 100.0)}
    assert by_pid[2]["from_s"] == 400.0 and abs(by_pid[2]["mb_per_10min"] - 10.0) < 1e-6
    late = rules.rss_growth(snaps, 100.0, 1000.0)  # a warm-up longer than what is left after the restart
    assert {g["pid"]: g["mb_per_10min"] for g in late}[2] is None


def snap(procs: dict, kv: dict | None = None, running: int = 0) -> dict:
    return {"procs": procs, "kv": kv or {"draft": {"used": 0.0, "requests": 0.0}}, "health": {"running": running}}


def test_idle_means_nothing_held_and_every_count_back_for_the_same_process():
    baseline: dict = {}
    seen: dict = {}
    first = snap({"gateway": {"pid": 1, "fds": 20, "threads": 2, "tasks": 12.0},
                  "draft": {"pid": 2, "fds": 16, "threads": 5, "tasks": 3.0}})
    assert rules.update_baseline(baseline, seen, first) == ["gateway", "draft"]
    assert rules.idle_differences(baseline, first) == []
    later = snap({"gateway": {"pid": 1, "fds": 21, "threads": 2, "tasks": 13.0},
                  "draft": {"pid": 9, "fds": 30, "threads": 9, "tasks": 7.0}},  # a restarted draft: not compared
                 kv={"draft": {"used": 4.0, "requests": 1.0}}, running=1)
    assert rules.idle_differences(baseline, later) == [
        "gateway running 1", "draft holds 4 KV blocks, 1 requests", "gateway fds 20 -> 21", "gateway tasks 12 -> 13.0"]
    assert rules.update_baseline(baseline, seen, later) == []  # the new draft's first checkpoint: not yet
    assert rules.update_baseline(baseline, seen, later) == ["draft"]  # its second one
    assert baseline["draft"]["pid"] == 9


def test_tpot_rule_compares_the_first_and_last_stretches_of_clean_load():
    wins = [{"from_s": float(a), "to_s": float(a + 10), "clean": a != 30} for a in range(0, 60, 10)]
    steady = [(a + 0.5 + i / 10, 20.0) for a in range(0, 60, 10) for i in range(10)]
    assert rules.tpot_rule(wins, steady, 0.1, 20.0)["ok"]
    slower = [(t, 20.0 if t < 40 else 25.0) for t, _ in steady]
    verdict = rules.tpot_rule(wins, slower, 0.1, 20.0)
    assert not verdict["ok"] and abs(verdict["ratio"] - 1.25) < 1e-9
    assert not rules.tpot_rule(wins, steady[:5], 0.1, 20.0)["ok"]  # too few requests to compare


def test_faults_are_spread_between_the_first_and_last_sixth():
    warmup, steps = soak.plan(600.0)
    assert warmup == 100.0 and [name for _, name in steps] == list(soak.FAULTS)
    times = [t for t, _ in steps]
    assert times == sorted(times) and times[0] > 100.0 and times[-1] < 500.0
