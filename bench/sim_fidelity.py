"""Fidelity of a simulation preset against the real stack, side by side (docs/simulation.md).

    .venv/bin/python bench/sim_fidelity.py [--preset cpu-demo] [--real-runs 2]

For each policy (none, chain:K, adaserve) and each load point, the real stack (bundled pair) and
the simulated stack (`--simulate PRESET`) are started fresh (bench/sweep.py's Stack) with the SAME
profile file, so both gateways use the same budget B and SLO classes, and `specserve bench` drives
them with the same seeds:
- c1: concurrency 1, the first short prompts in order, 64 tokens each, critical tier;
- c16: 16 requests at once (AdaServe's mix), at most 16 in flight;
- two Poisson rates of AdaServe's mix.
Reported per point: mean tokens per verify step, TPOT p50, SLO attainment; the real stack's
run-to-run spread (min-max over --real-runs) beside its median. Results: bench/results/sim_fidelity.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import ROOT, Stack, bench_point, load_result, measure_profile, warm_up  # noqa: E402

from specserve.cli.loadgen.workload import DEFAULT_MIX  # noqa: E402

METRICS = ("tokens_per_step", "tpot_p50_ms", "attainment")


def points(rates: list[float], duration_s: float) -> list[tuple[str, dict]]:
    out = [("c1", dict(num_requests=6, max_tokens=64, mix="critical=1.0:short", sequential_prompts=True,
                       max_concurrency=1)),
           ("c16", dict(num_requests=16, max_concurrency=16, mix=DEFAULT_MIX))]
    for rate in rates:
        out.append((f"rate{rate:g}", dict(num_requests=max(8, round(rate * duration_s)), request_rate=rate,
                                          mix=DEFAULT_MIX)))
    return out


def run_stack(policy: str, profile: Path, simulate: str | None, plan: list[tuple[str, dict]], seed: int,
              tmp: Path) -> dict:
    out = {}
    with Stack(policy, profile, 1, [], simulate) as stack:
        warm_up(stack.url, tmp / "warm.jsonl")
        for name, fields in plan:
            summary = bench_point(stack.url, tmp / f"{name}.jsonl", f"{policy} {name}", seed=seed, **fields)
            out[name] = {m: summary[m] for m in METRICS} | {"requests": summary["requests"],
                                                            "errors": summary["errors"]}
    return out


def markdown(results: dict) -> str:
    """The side-by-side table: real median (min-max over runs) vs simulated, per policy and point."""
    lines = [f"Simulated: preset `{results['preset']}` ({results['date']}); real: the bundled pair, "
             f"{len(next(iter(results['policies'].values()))['runs']['real'])} runs (median, min-max).", "",
             "| policy | point | tokens/step real | sim | TPOT p50 ms real | sim | attainment real | sim |",
             "|---|---|---|---|---|---|---|---|"]
    for policy, data in results["policies"].items():
        for point, row in data["points"].items():
            cells = []
            for m, fmt in (("tokens_per_step", "{:.2f}"), ("tpot_p50_ms", "{:.1f}"), ("attainment", "{:.2f}")):
                v = row[m]
                cells += [f"{fmt.format(v['real_median'])} ({fmt.format(v['real_min'])}-{fmt.format(v['real_max'])})",
                          fmt.format(v["simulated"])]
            lines.append(f"| {policy} | {point} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--policies", default="none,chain:4,adaserve")
    ap.add_argument("--rates", default="0.5,1.0")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--real-runs", type=int, default=2)
    ap.add_argument("--sim-runs", type=int, default=1)
    ap.add_argument("--profile", default=None, help="the real target's profile (default: measure one)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sim_fidelity.json"))
    ap.add_argument("--report", metavar="JSON", help="only print the markdown table of a results file")
    args = ap.parse_args()
    if args.report:
        print(markdown(load_result(args.report)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="sim-fidelity-"))
    profile = Path(args.profile) if args.profile else tmp / "profile.json"
    if not args.profile:
        measure_profile(profile, 1, quick=True)
    plan = points([float(r) for r in args.rates.split(",")], args.duration_s)
    results: dict = {"preset": args.preset, "simulated_label": f"simulated, preset {args.preset}",
                     "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "profile": json.loads(profile.read_text()), "plan": {n: f for n, f in plan}, "policies": {}}
    for policy in args.policies.split(","):
        runs: dict[str, list[dict]] = {"real": [], "simulated": []}
        for run in range(max(args.real_runs, args.sim_runs)):
            for kind, n, sim in (("real", args.real_runs, None), ("simulated", args.sim_runs, args.preset)):
                if run < n:
                    print(f"{policy}: {kind} run {run}", file=sys.stderr, flush=True)
                    runs[kind].append(run_stack(policy, profile, sim, plan, seed=run, tmp=tmp))
        table = {}
        for name, _ in plan:
            row = {}
            for m in METRICS:
                real = [r[name][m] for r in runs["real"]]
                sim = [r[name][m] for r in runs["simulated"]]
                row[m] = {"real_median": statistics.median(real), "real_min": min(real), "real_max": max(real),
                          "simulated": statistics.median(sim)}
            table[name] = row
        results["policies"][policy] = {"points": table, "runs": runs}
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
