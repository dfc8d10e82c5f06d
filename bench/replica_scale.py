"""Replicas scale: the request rate at which SLO attainment falls to 50 %, on 4 and on 8 simulated
target replicas behind one gateway (issue 31, target 3).

    .venv/bin/python bench/replica_scale.py [--simulate llama2-7b-a100,time_scale=2] [--targets 4,8]
        [--per-replica 4,6,8,10,12] [--rounds 3] [--duration-s 10] [--baseline /tmp/base]

The default serving setting (policy `joint`, SLO admission, the round-robin router), AdaServe's mix
(bench/admission.py's: 60 % critical on short prompts, 20 % search on long ones, 20 % flex chat), the
preset's SLO classes. Each point sends `--duration-s` of Poisson arrivals at `rate = N x per-replica
rate` and counts the requests served within their SLO (refused ones count as missed). The capacity is
where attainment first crosses 50 %, interpolated linearly between the two grid rates around it (the
last rate when it never does, marked `>`). Rounds are interleaved: every replica count (and version)
once, then again; the median and range over the rounds are reported, and the ratio 8 : 4 per round.

The services are simulated (docs/simulation.md): every figure here is SIMULATED. `--baseline DIR`
runs an earlier checkout's gateway and services beside this one (as bench/call_cost.py does: its
packages first on PYTHONPATH through a symlink tree), so a change's effect is measured side by side;
`--checkout DIR` runs a frozen copy as the later version. A checkout is `git archive REV services
shared | tar -x -C DIR` with `models` and `bench/workloads` linked to this checkout's.

Results: bench/results/replica_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import admission  # noqa: E402
from call_cost import _pythonpath  # noqa: E402
from schedule_cost import package_tree  # noqa: E402
from sweep import ROOT, machine_info, relative_paths, spread  # noqa: E402

OUT = ROOT / "bench" / "results" / "replica_scale.json"


def capacity_at(points: list[tuple[float, float]], goal: float = 0.5) -> tuple[float, bool]:
    """(the rate where attainment first falls below `goal`, linearly between the grid rates around
    it; whether it did fall within the grid). Points: (rate, attainment), rising rates."""
    prev_rate, prev_att = 0.0, 1.0
    for rate, att in points:
        if att < goal:
            return prev_rate + (rate - prev_rate) * (prev_att - goal) / (prev_att - att), True
        prev_rate, prev_att = rate, att
    return prev_rate, False


def run_scan(args: argparse.Namespace, targets: int, round_: int, version: str) -> list[dict]:
    ns = argparse.Namespace(policy=args.policy, profile=args.profile, threads=1, router=args.router,
                            gateway_args=args.gateway_args, simulate=args.simulate, targets=targets)
    points = []
    with admission.stack_for(ns, "slo") as stack:
        for per in args.per_replica:
            rate = per * targets
            label = f"replica-scale-{version}-x{targets}-r{round_}-{rate:g}"
            n_requests = admission.n_for(rate, args.duration_s)
            p = admission.run_point(stack, label, args.seed + round_, num_requests=n_requests, request_rate=rate)
            points.append({"rate": rate, "per_replica": per} | p)
            if (p["attainment"] or 0.0) < args.stop_below:
                break  # past the capacity: higher rates only take longer
    return points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulate", default="llama2-7b-a100,time_scale=2")
    ap.add_argument("--targets", default="4,8")
    ap.add_argument("--per-replica", default="3,4.5,6,7.5,9,10.5", help="request rates per replica (req/s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--policy", default="joint")
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--gateway-args", default="")
    ap.add_argument("--profile", default=None, help="default: the preset's, measured once")
    ap.add_argument("--stop-below", type=float, default=0.3, help="stop a scan at the first point below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default=None, help="an earlier checkout to run beside this one")
    ap.add_argument("--checkout", default=None, help="the later checkout (default: this one), e.g. a frozen copy "
                    "so that edits made while the bench runs do not reach it")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    args.per_replica = [float(x) for x in args.per_replica.split(",")]
    counts = [int(x) for x in args.targets.split(",")]
    ns = argparse.Namespace(profile=args.profile, simulate=args.simulate)
    args.profile = str(admission.profile_for(ns))
    after = str(package_tree(Path(args.checkout).resolve())) if args.checkout else None
    versions = {"after": after}
    if args.baseline:
        versions = {"before": str(package_tree(Path(args.baseline).resolve())), "after": after}

    runs: list[dict] = []
    for r in range(args.rounds):
        for version, path in versions.items():
            for n in counts:
                with _pythonpath(path):
                    points = run_scan(args, n, r, version)
                cap, crossed = capacity_at([(p["rate"], p["attainment"] or 0.0) for p in points])
                runs.append({"version": version, "targets": n, "round": r, "capacity_rate": cap, "crossed": crossed,
                             "points": points})
                print(f"{version} x{n} round {r}: capacity at 50 % {'' if crossed else '> '}{cap:.1f} req/s",
                      file=sys.stderr, flush=True)

    summary = {}
    for version in versions:
        caps = {n: [x["capacity_rate"] for x in runs if x["version"] == version and x["targets"] == n] for n in counts}
        entry = {f"x{n}": spread(c) for n, c in caps.items()}
        if len(counts) == 2:
            lo, hi = counts
            entry[f"ratio_{hi}_{lo}"] = spread([b / a for a, b in zip(caps[lo], caps[hi], strict=True) if a])
        summary[version] = entry
    result = {"meta": machine_info() | {"argv": sys.argv[1:]}, "simulated": True, "preset": args.simulate,
              "setting": {"policy": args.policy, "admission": "slo", "router": args.router, "mix": admission.MIX,
                          "duration_s": args.duration_s, "per_replica": args.per_replica,
                          "gateway_args": args.gateway_args.split(), "baseline": args.baseline,
                          "checkout": args.checkout,
                          "profile": args.profile},
              "summary": summary, "runs": runs}
    Path(args.out).write_text(json.dumps(relative_paths(result), indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"results: {os.path.relpath(args.out, ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
