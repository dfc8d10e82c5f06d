"""One-token decode cost of the bundled draft and target, and their ratio; code versions side by side.

    .venv/bin/python bench/forward_pair.py [--rounds 5] [--calls 100] [--threads 1,2]
        [--dtype float32|bfloat16] [--variant NAME=PYTHONPATH ...] [--out FILE.json]

Each round starts one fresh process per variant, variants alternating, so the machine's drift hits
them alike. A process loads `models/target` and `models/draft` through `ModelRunner.from_dir`, gives
one request `--context` committed tokens (a real prefill), then per thread count times `--calls`
1-token decodes of the target and the draft alternating: a root-only `Tree` (the request's last
committed token, whose KV is not cached yet: exactly a decode step's work), discarded after each
call. Only `runner.forward` is timed (input building included). Reported per variant and thread
count: the median over rounds of each round's median (min-max over rounds) for each model, and the
target/draft cost ratio; between variants, each model's ratio of medians.

A variant is a PYTHONPATH under which `specserve` imports another checkout of the code (for example
a `git archive` of the base commit with the package's folders linked as `specserve/`); without
--variant only the code this interpreter imports is measured ("current").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("target", "draft")


def worker(args: argparse.Namespace) -> dict:
    import torch

    from specserve.shared.runtime.batch import Chunk, Tree
    from specserve.shared.runtime.runner import ModelRunner

    out: dict = {}
    with torch.inference_mode():
        runners = {m: ModelRunner.from_dir(args.models / m, 64, 16, args.dtype) for m in MODELS}
        for r in runners.values():
            r.forward([Chunk("c", [1 + i % 100 for i in range(args.context)])])
        for threads in args.threads:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {m: [] for m in MODELS}
            for i in range(args.warmup + args.calls):
                for m, r in runners.items():
                    entries = [Tree("c", [5], [-1])]
                    t0 = time.perf_counter()
                    r.forward(entries)
                    elapsed = time.perf_counter() - t0
                    r.discard_tree("c")
                    if i >= args.warmup:
                        times[m].append(elapsed * 1e3)
            out[str(threads)] = {m: statistics.median(v) for m, v in times.items()}
    return out


def parse_variant(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant takes NAME=PYTHONPATH, got {text!r}")
    return name, path


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100, help="timed decodes per model, thread count and round")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--context", type=int, default=128, help="committed tokens before the decodes")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--models", type=Path, default=ROOT / "models", help="folder holding target/ and draft/")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    help="NAME=PYTHONPATH of a code version to measure (repeatable)")
    ap.add_argument("--out", type=Path, help="also write the per-round figures as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads takes comma-separated integers, got {args.threads!r}")
    if args.rounds < 1 or args.calls < 1 or args.warmup < 0 or args.context < 1 or min(args.threads) < 1:
        ap.error("--rounds, --calls, --context and --threads must be >= 1, --warmup >= 0")
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    variants = args.variant or [("current", os.environ.get("PYTHONPATH", ""))]
    passed = ["--calls", str(args.calls), "--warmup", str(args.warmup), "--context", str(args.context),
              "--threads", ",".join(map(str, args.threads)), "--dtype", args.dtype, "--models", str(args.models)]
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rounds: list[dict[str, dict]] = []
    for i in range(args.rounds):
        row = {}
        for name, path in variants:
            env = {**os.environ, "PYTHONPATH": path}
            done = subprocess.run([sys.executable, __file__, "--worker", *passed], env=env, check=True,
                                  capture_output=True, text=True)
            row[name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {i + 1}/{args.rounds} {name}: {row[name]}", file=sys.stderr)
        rounds.append(row)

    lines = [f"1-token decode at {args.context} tokens of KV, {args.dtype}, ms: median over {args.rounds} rounds "
             f"of each round's median of {args.calls} calls (min-max over rounds); load average (1/5/15 min) "
             f"before {load_before}, after " + " ".join(f"{x:.2f}" for x in os.getloadavg()), "",
             "| variant | threads | target ms | draft ms | target / draft |", "|---|---:|---:|---:|---:|"]
    medians: dict[tuple[str, int], dict[str, float]] = {}
    for name, _ in variants:
        for t in args.threads:
            per = {m: [r[name][str(t)][m] for r in rounds] for m in MODELS}
            ratio = [r[name][str(t)]["target"] / r[name][str(t)]["draft"] for r in rounds]
            medians[name, t] = {m: statistics.median(v) for m, v in per.items()}
            lines.append(f"| {name} | {t} | {spread(per['target'])} | {spread(per['draft'])} "
                         f"| {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) |")
    if len(variants) > 1:
        first = variants[0][0]
        lines += ["", f"| variant | threads | target vs {first} | draft vs {first} |", "|---|---:|---:|---:|"]
        for name, _ in variants[1:]:
            for t in args.threads:
                a, b = medians[first, t], medians[name, t]
                lines.append(f"| {name} | {t} | {a['target'] / b['target']:.2f}x faster "
                             f"| {a['draft'] / b['draft']:.2f}x faster |")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) for k, v in vars(args).items() if k not in ("variant", "models", "out")}
        args.out.write_text(json.dumps({"args": settings, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
