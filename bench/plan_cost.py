"""One replica's plan per iteration, in-process: the cost model's refit and `Scheduler.plan`.

What a step loop pays to plan one iteration of one replica in the steady state of decoding (the last
iteration's pass fitted into the replica's cost model, then the plan): `running`
decoding requests on the replica in AdaServe's 60/20/20 mix of three tiers (TPOT 12 / 30 / 100 ms, a
spread of output so far and left), nobody waiting, the draft up. The replica's cost model has timed
passes of 1..`--table` tokens (the table a replica builds as it serves), and each request has a few
verify steps in the acceptance estimate. The median and min-max over `--repeats` plans per point go to
stdout and `--out` (JSON), with the `specserve` package's path, so that two checkouts can be run side by
side by putting each first on PYTHONPATH (bench/schedule_cost.py's `package_tree`):

    PYTHONPATH=$PKG .venv/bin/python bench/plan_cost.py --policy joint --running 1 32 128 --out FILE
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import specserve
from specserve.gateway.perf.cost import PassCost, PassSample
from specserve.gateway.sched.admission.slo import SloAdmission
from specserve.gateway.sched.plan import DraftView, Limits, ReplicaView, RequestView, SchedulerView
from specserve.gateway.sched.policy import make_policy
from specserve.gateway.sched.routing import make_router
from specserve.gateway.sched.scheduler import Scheduler

TIERS = [("critical", 12.0, 1000.0), ("search", 30.0, 2000.0), ("chat", 100.0, 5000.0)]  # ms: TPOT, TTFT
MIX = [0, 0, 0, 1, 2]  # 60/20/20, AdaServe's mix


def cost_model(table: int) -> PassCost:
    """A replica's cost model that has timed passes of 1..table tokens (about 15 + 0.05 ms a token)."""
    cost = PassCost(64, 16.6, [(t, 15.0 + 0.05 * t) for t in (1, 8, 16, 64, 128, 256, 512)])
    rng = random.Random(0)
    for _ in range(3):
        for n in range(1, table + 1):
            ms = 15.0 + 0.05 * n + rng.uniform(-0.3, 0.3)
            cost.observe(PassSample(n, ms, ms + 0.3, ms + 1.0, 0.4, kv=16 * n))
    return cost


def snapshot(running: int, cost: PassCost, rng: random.Random) -> SchedulerView:
    decoding = []
    for i in range(running):
        name, tpot, ttft = TIERS[MIX[i % len(MIX)]]
        decoded = rng.randint(2, 200)
        decoding.append(RequestView(f"r{i}", name, tpot, ttft, decoded, decoded * tpot * rng.uniform(0.7, 1.3),
                                    rng.randint(2, 200), [], 0, rng.randint(0, 3), 16))
    rep = ReplicaView(0, True, 100_000, running * 16, running, cost)
    return SchedulerView([], [], decoding, [rep], DraftView(True, False), Limits(1024, 256, 16, 16), replica=0,
                         live={r.rid for r in decoding})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="joint")
    ap.add_argument("--running", type=int, nargs="+", default=[1, 4, 8, 16, 32, 128])
    ap.add_argument("--table", type=int, default=160, help="token counts the cost model has timed")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for running in args.running:
        scheduler = Scheduler(make_policy(args.policy), make_router("slo"), admission=SloAdmission(route_all=True))
        control = getattr(scheduler.policy, "control", None)
        rng = random.Random(1)
        if control is not None:  # a few verify steps per request in the acceptance estimate
            for i in range(running):
                for _ in range(4):
                    control.acceptance.observe(f"r{i}", 3, rng.randint(0, 3))
        cost = cost_model(args.table)
        views = [snapshot(running, cost, random.Random(step)) for step in range(args.repeats)]
        passes = [PassSample(n, 15.0 + 0.05 * n, 15.3 + 0.05 * n, 16.0 + 0.05 * n, 0.4, kv=16 * running)
                  for n in (rng.randint(running, running + 8) for _ in views)]
        times = []
        for step, view in enumerate(views):
            t0 = time.perf_counter()
            cost.observe(passes[step])
            scheduler.plan(view, step)
            times.append((time.perf_counter() - t0) * 1e6)
        rows.append({"running": running, "median_us": round(statistics.median(times), 1),
                     "min_us": round(min(times), 1), "max_us": round(max(times), 1)})
        print(f"{args.policy} running {running}: {rows[-1]['median_us']:.0f} us "
              f"({rows[-1]['min_us']:.0f}-{rows[-1]['max_us']:.0f})", flush=True)
    Path(args.out).write_text(json.dumps({"package": str(Path(specserve.__file__).parent),
                                          "args": {k: v for k, v in vars(args).items() if k != "out"},
                                          "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
