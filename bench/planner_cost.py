"""The SLO-aware admission planner's own cost per call (SloAdmission.propose), in-process.

One replica with `running` decoding requests spread over the three default tiers, 4 requests still
prefilling (forced nodes) and `new` waiting requests offered (the planner takes up to 8 per call);
the cost model is the bundled pair's profile shape (5 ms + 0.1 ms per token; its numbers do not change
the work the DP does, only which requests fit). The median and min-max of `--repeats` calls per
point, and the call's share of a reference iteration given by `--iteration-ms`, go to stdout and
bench/results/planner_cost.json.

    .venv/bin/python bench/planner_cost.py --repeats 200 --iteration-ms 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specserve.gateway.perf.cost import PassCost  # noqa: E402
from specserve.gateway.sched.admission.slo import SloAdmission  # noqa: E402
from specserve.gateway.sched.plan import (  # noqa: E402
    DraftView,
    Limits,
    PrefillView,
    ReplicaView,
    RequestView,
    SchedulerView,
    WaitingView,
)

TIERS = [("critical", 12.0, 1000.0), ("search", 30.0, 2000.0), ("chat", 100.0, 5000.0)]  # ms: TPOT, TTFT
MIX = [0, 0, 0, 1, 2]  # 60/20/20, AdaServe's mix


def snapshot(running: int, new: int) -> SchedulerView:
    lat = PassCost(64, 6.0, [(t, 5.0 + 0.1 * t) for t in (1, 8, 16, 64, 128, 256, 512)])
    decoding = []
    for i in range(running):
        name, tpot, ttft = TIERS[MIX[i % len(MIX)]]
        decoding.append(RequestView(f"r{i}", name, tpot, ttft, 10, 10 * tpot, 200, [], 0, 0))
    prefilling = []
    for i in range(4):
        name, tpot, ttft = TIERS[MIX[i % len(MIX)]]
        prefilling.append(PrefillView(f"p{i}", 0, 300, 100, name, tpot, ttft, 50.0 * i))
    waiting = []
    for i in range(new):
        name, tpot, ttft = TIERS[MIX[(i + 1) % len(MIX)]]
        waiting.append(WaitingView(f"w{i}", 100 + 37 * i, 128, 16, name, tpot, ttft, 5.0 * i, i % 2 == 0))
    rep = ReplicaView(0, True, 100_000, running * 16, running + 4, lat)
    return SchedulerView(waiting, prefilling, decoding, [rep], DraftView(False, False), Limits(1024, 4096, 16, 16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--new", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--iteration-ms", type=float, default=40.0,
                    help="the reference iteration the share is taken of, ms")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "planner_cost.json"))
    args = ap.parse_args()
    rows = []
    for running in args.running:
        for new in args.new:
            adm = SloAdmission()
            best = {w.rid for w in snapshot(running, new).waiting if w.best_effort}
            times = []
            for _ in range(args.repeats):
                view = snapshot(running, new)
                t0 = time.perf_counter()
                adm.propose(view, best, None)
                times.append((time.perf_counter() - t0) * 1e3)
            med = statistics.median(times)
            rows.append({"running": running, "new": new, "median_ms": round(med, 4),
                         "min_ms": round(min(times), 4), "max_ms": round(max(times), 4),
                         "share_of_iteration": round(med / args.iteration_ms, 4)})
    print(f"| running | new offered | planner ms, median (min-max) | share of a {args.iteration_ms:g} ms iteration |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['running']} | {r['new']} | {r['median_ms']:.3f} ({r['min_ms']:.3f}-{r['max_ms']:.3f}) "
              f"| {100 * r['share_of_iteration']:.1f}% |")
    Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"},
                                          "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
