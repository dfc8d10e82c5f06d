"""One gateway in front of N simulated target replicas at GPU-scale timings: the gateway's own
scheduling time per iteration and its share of the iteration, at batch b per replica.

    .venv/bin/python bench/sim_scale.py [--preset llama2-7b-a100] [--targets 8]
        [--batches 1,32,128] [--policy adaserve]

The services are simulated (docs/simulation.md): the target passes and draft steps take the
preset's modelled time and almost no CPU, so what remains on this 2-core machine is the gateway
(and the load generator, which shares the cores: the figures are an upper bound on the gateway's
cost). Each point sends targets x b requests at once (at most that many in flight; short prompts,
critical tier, 64 tokens, EOS ignored) and reads the gateway's iteration counters
(specserve:iteration_{draft,target,transport,schedule}_seconds_total, iterations_total) before
and after. Results: bench/results/sim_scale.json (labelled simulated, with the preset).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import ROOT, Stack, bench_point, measure_profile, warm_up  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama2-7b-a100")
    ap.add_argument("--targets", type=int, default=8)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--policy", default="adaserve")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sim_scale.json"))
    ap.add_argument("--profile-out", default=None, help="write the simulated profile here (default: a temp dir)")
    args = ap.parse_args()
    # Simulated pools hold no tensors: size them for the largest batch (one draft serves every replica).
    batches = [int(b) for b in args.batches.split(",")]
    os.environ.setdefault("SPECSERVE_TARGET_KV_BLOCKS", str(max(batches) * 40))
    os.environ.setdefault("SPECSERVE_DRAFT_KV_BLOCKS", str(max(batches) * 40 * args.targets))
    tmp = Path(tempfile.mkdtemp(prefix="sim-scale-"))
    profile = Path(args.profile_out) if args.profile_out else tmp / "profile.json"
    measure_profile(profile, 1, quick=True, simulate=args.preset)
    result: dict = {"label": f"simulated, preset {args.preset}", "preset": args.preset, "targets": args.targets,
                    "policy": args.policy, "max_tokens": args.max_tokens,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "profile": json.loads(profile.read_text()), "points": {}}
    # the gateway must admit b requests per replica at once
    gateway_args = ["--max-running", str(max(batches)), "--max-waiting", str(2 * max(batches) * args.targets)]
    result["gateway_args"] = gateway_args
    with Stack(args.policy, profile, 1, gateway_args, args.preset, targets=args.targets) as stack:
        warm_up(stack.url, tmp / "warm.jsonl")
        for b in batches:
            n = b * args.targets
            summary = bench_point(stack.url, tmp / f"b{b}.jsonl", f"b{b}", num_requests=n, max_concurrency=n,
                                  max_tokens=args.max_tokens, mix="critical=1.0:short", timeout_s=1200)
            it = summary["iteration"]
            per_iter = {p: s / it["iterations"] * 1e3 for p, s in it["seconds"].items()} if it["iterations"] else {}
            result["points"][str(b)] = {"requests": n, "errors": summary["errors"], "iterations": it["iterations"],
                                        "iteration_ms": it["mean_ms"], "per_iteration_ms": per_iter,
                                        "share": it["share"], "tokens_per_step": summary["tokens_per_step"],
                                        "tpot_p50_ms": summary["tpot_p50_ms"],
                                        "throughput_tok_s": summary["throughput_tok_s"]}
            print(b, json.dumps(result["points"][str(b)]), file=sys.stderr, flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
