"""The cost model's prediction error (issue 30, target 5): how well PassCost prices an iteration.

Every iteration the gateway prices with its replica's PassCost (services/gateway/perf/cost.py) before it
fits the model to it, so the relative error |T - T̂| / T of those out-of-sample predictions is the
model's error as the planner and the policies meet it. The gateway serves the error's median and p90
over its recent iterations in GET /v1/slo_classes (`cost_error`); this bench reads them after load.

Per setting, per policy, per run: fresh target, draft and gateway (bench/sweep.py's Stack), a
warm-up, a concurrency-1 point (the sweep's) and load points at the setting's rates (AdaServe's
60/20/20 mix), then the gateway's error over every iteration of the run. Settings:

- `sim-7b`: SIMULATED, preset llama2-7b-a100 at time_scale 4 (the sweep's `sim-7b-x4` profile);
- `sim-70b`: SIMULATED, preset llama2-70b-4xa100 at time_scale 2 (`sim-70b-x2`);
- `cpu`: the real CPU stack, the bundled pair (the full sweep's profile).

    .venv/bin/python bench/cost_error.py --settings sim-7b,sim-70b,cpu --runs 3

Results: bench/results/cost_error.json, and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from sweep import Stack, load_point, slo_classes, slug, solo_point, warm_up  # noqa: E402

SETTINGS = {
    "sim-7b": {"simulate": "llama2-7b-a100,time_scale=4", "profile": "bench/results/sweep-sim-7b-x4/profile.json",
               "rates": [3.0, 6.0], "duration_s": 25.0, "min_requests": 100, "solo": 8,
               "label": "SIMULATED llama2-7b-a100, time_scale 4 (shared/simulate/presets/llama2-7b-a100.toml)"},
    "sim-70b": {"simulate": "llama2-70b-4xa100,time_scale=2",
                "profile": "bench/results/sweep-sim-70b-x2/profile.json",
                "rates": [3.0, 6.0], "duration_s": 25.0, "min_requests": 100, "solo": 8,
                "label": "SIMULATED llama2-70b-4xa100, time_scale 2 (shared/simulate/presets/llama2-70b-4xa100.toml)"},
    "cpu": {"simulate": None, "profile": "bench/results/sweep-full/profile.json", "rates": [0.5],
            "duration_s": 40.0, "min_requests": 20, "solo": 8, "label": "real CPU stack, the bundled pair"},
}


def one_run(name: str, policy: str, run: int, out: Path, seed: int) -> dict:
    s = SETTINGS[name]
    with Stack(policy, ROOT / s["profile"], 1, [], s["simulate"]) as stack:
        warm_up(stack.url, out / "warm-up.jsonl")
        solo_point(stack.url, out / f"{name}-{slug(policy)}-solo-run{run}.jsonl", policy, s["solo"])
        for i, rate in enumerate(s["rates"]):
            load_point(stack.url, out / f"{name}-{slug(policy)}-rate{rate:g}-run{run}.jsonl", policy, rate,
                       s["duration_s"], s["min_requests"], seed + 1000 * run + i)
        return slo_classes(stack.url)["cost_error"]["0"]


def median_spread(values: list[float]) -> str:
    return f"{100 * statistics.median(values):.1f} ({100 * min(values):.1f}-{100 * max(values):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="sim-7b,sim-70b,cpu")
    ap.add_argument("--policies", default="joint;chain:4", help="';'-separated")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cost_error.json"))
    args = ap.parse_args()
    out_dir = ROOT / "bench" / "results" / "cost_error"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.settings.split(","):
        for policy in args.policies.split(";"):
            for run in range(args.runs):
                t0 = time.time()
                err = one_run(name, policy, run, out_dir, args.seed)
                rows.append({"setting": name, "policy": policy, "run": run} | err)
                print(f"{name} {policy} run {run}: {err} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps({"settings": {n: SETTINGS[n] for n in args.settings.split(",")},
                                          "policies": args.policies, "runs": args.runs, "rows": rows}, indent=1) + "\n")
    print("| setting | policy | iterations per run | median abs. error %, median (min-max) over runs | p90 % |")
    print("|---|---|---:|---:|---:|")
    for name in args.settings.split(","):
        for policy in args.policies.split(";"):
            mine = [r for r in rows if r["setting"] == name and r["policy"] == policy and r.get("iterations")]
            if mine:
                n = statistics.median(r["iterations"] for r in mine)
                med, p90 = median_spread([r["median"] for r in mine]), median_spread([r["p90"] for r in mine])
                print(f"| {SETTINGS[name]['label']} | {policy} | {n:.0f} | {med} | {p90} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
