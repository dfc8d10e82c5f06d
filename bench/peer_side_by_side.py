"""Concurrency 1, side by side: specserve (some policies) and transformers, interleaved in rounds.

    .venv/bin/python bench/peer_side_by_side.py --rounds 3 [--policies 'none;chain:6;adaserve']
        [--profile bench/results/sweep-full/profile.json] [--out bench/results/peer_side_by_side.json]

A policy may carry gateway flags ('chain:4 --overlap' runs chain:4 with drafting ahead).

The speed of the 2-core development machine drifts by up to 1.8x within a day, so a peer measured
at another time cannot be set beside our numbers. Here each round runs, one after another: each
policy's fresh specserve stack on the first 8 short prompts (64 tokens each, one at a time, critical
tier, as bench/sweep.py's concurrency-1 point) and then 16 requests at once cycling through the same
8 prompts (chat tier), then bench/hf_peer.py on the same prompts (generate, assisted generation,
batched generate at 8 and 16, the best kept). Reported: the median over rounds of each round's
tokens/s and median TPOT, and ratios to transformers' `generate` taken within each round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 16  # requests sent at once for the batched point (transformers' batch of 16)


def _sweep():
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "bench" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="none;chain:6;adaserve",
                    help="';'-separated; a policy may carry gateway flags: 'chain:4 --overlap'")
    ap.add_argument("--profile", default=str(ROOT / "bench" / "results" / "sweep-full" / "profile.json"),
                    help="the profile every gateway reads (B, SLO classes)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "peer_side_by_side.json"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.prompts < 1:
        ap.error("--rounds and --prompts must be >= 1")
    if not Path(args.profile).is_file():
        ap.error(f"no profile at {args.profile}: run `specserve profile --out {args.profile}` first")
    sweep = _sweep()
    policies = args.policies.split(";")
    work = Path(args.out).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    # The first N short prompts as their own prompt set, so that "16 at once" cycles through the same
    # N prompts as transformers' batch of 16 does.
    rows = (ROOT / "bench" / "workloads" / "short.jsonl").read_text().splitlines()[: args.prompts]
    prompts = work / "prompts.jsonl"
    prompts.write_text("\n".join(rows) + "\n")
    rounds = []
    for i in range(args.rounds):
        row = {}
        for policy in policies:
            print(f"round {i + 1}/{args.rounds}: specserve {policy}", file=sys.stderr, flush=True)
            name, *gateway_args = policy.split()  # e.g. "chain:4 --overlap": a policy and gateway flags
            with sweep.Stack(name, Path(args.profile), 1, gateway_args) as stack:
                sweep.warm_up(stack.url, work / "warm-up.jsonl")
                s = sweep.solo_point(stack.url, work / f"{sweep.slug(policy)}-round{i}.jsonl", policy, args.prompts)
                b = sweep.bench_point(stack.url, work / f"{sweep.slug(policy)}-batch-round{i}.jsonl", policy,
                                      num_requests=BATCH, max_tokens=sweep.SOLO["max_tokens"],
                                      mix=f"chat=1:{prompts}", sequential_prompts=True)
            row[f"specserve {policy}"] = {"tokens_per_s": s["throughput_tok_s"], "tpot_ms": s["tpot_p50_ms"],
                                          "tokens_per_step": s["tokens_per_step"]}
            row[f"specserve {policy}, {BATCH} at once"] = {"tokens_per_s": b["throughput_tok_s"],
                                                           "tpot_ms": b["tpot_p50_ms"],
                                                           "tokens_per_step": b["tokens_per_step"]}
        print(f"round {i + 1}/{args.rounds}: transformers", file=sys.stderr, flush=True)
        peer = sweep.run_hf_peer(work / f"hf_peer-round{i}.json", args.prompts)
        if peer is None:
            return 1
        res = peer["results"]
        for mode in ("generate", "assisted"):
            row[f"transformers {mode}"] = {"tokens_per_s": res[mode]["tokens_per_s"]["median"],
                                           "tpot_ms": res[mode]["tpot_ms"]["median"],
                                           "tokens_per_step": res[mode].get("acceptance", {}).get(
                                               "tokens_per_target_forward", 1.0)}
        best = res["batched"]["best"]
        row[f"transformers batched generate, batch {best['batch_size']}"] = {
            "tokens_per_s": best["tokens_per_s"], "tpot_ms": None, "tokens_per_step": None}
        rounds.append(row)
    report = {"rounds": rounds, "policies": policies, "prompts": args.prompts, "profile": args.profile}
    Path(args.out).write_text(json.dumps(sweep.relative_paths(report), indent=1) + "\n")
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    rounds = report["rounds"]
    lines = ["| server | tokens/s | TPOT p50 (ms) | tokens/step | tokens/s vs transformers generate (same round) |",
             "|---|---:|---:|---:|---:|"]

    def med(key: str, field: str) -> str:
        vals = [r[key][field] for r in rounds if r[key][field] is not None]
        if not vals:
            return "-"
        return f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})"

    for key in rounds[0]:
        ratio = statistics.median(r[key]["tokens_per_s"] / r["transformers generate"]["tokens_per_s"] for r in rounds)
        lines.append(f"| {key} | {med(key, 'tokens_per_s')} | {med(key, 'tpot_ms')} | {med(key, 'tokens_per_step')} | "
                     f"{ratio:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
