"""Does the draft beside the target slow the target? The bundled models' decode steps, alone and at once.

    .venv/bin/python bench/overlap_contention.py [--rounds 3] [--seconds 4] [--tree 5] [--out FILE.json]

Two processes, one torch thread each (as `specserve up` runs the services on this machine): one runs the
target's verify step (a chain of `--tree` tokens at 128 tokens of KV, as chain:4 sends it), the other the
draft's 1-token decode. Each round times, for `--seconds` each: the target alone, the draft alone, then
both at once (started together). Reported: the median step time of each (median over rounds, min-max),
and the slowdown at once / alone. On a machine with a free core per process the slowdown is 1.0x; what
`--overlap` (drafting ahead) can win is bounded by it.
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


def worker(model: str, tree: int, start: float, seconds: float) -> list[float]:
    import torch

    from specserve.shared.runtime.batch import Chunk, Tree
    from specserve.shared.runtime.runner import ModelRunner

    torch.set_num_threads(1)
    times = []
    with torch.inference_mode():
        runner = ModelRunner.from_dir(ROOT / "models" / model, 64, 16, "float32")
        runner.forward([Chunk("c", [1 + i % 100 for i in range(128)])])
        n = tree if model == "target" else 1
        entry = Tree("c", [5 + i for i in range(n)], list(range(-1, n - 1)))
        for _ in range(5):  # warm-up
            runner.forward([entry])
            runner.discard_tree("c")
        while time.time() < start:
            time.sleep(0.001)
        while time.time() < start + seconds:
            t0 = time.perf_counter()
            runner.forward([entry])
            times.append((time.perf_counter() - t0) * 1e3)
            runner.discard_tree("c")
    return times


def run(models: list[str], args: argparse.Namespace) -> dict[str, float]:
    start = time.time() + 8.0  # both loaded and warm before the clock starts
    procs = {m: subprocess.Popen([sys.executable, __file__, "--worker", m, "--tree", str(args.tree),
                                  "--start", str(start), "--seconds", str(args.seconds)],
                                 stdout=subprocess.PIPE, text=True) for m in models}
    return {m: statistics.median(json.loads(p.communicate()[0])) for m, p in procs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--tree", type=int, default=5, help="tokens in the target's verify step (root included)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0 or args.tree < 1:
        ap.error("--rounds and --tree must be >= 1, --seconds > 0")
    if args.worker:
        print(json.dumps(worker(args.worker, args.tree, args.start, args.seconds)))
        return 0
    load = os.getloadavg()[0]
    rounds = []
    for i in range(args.rounds):
        row = {"target alone": run(["target"], args)["target"], "draft alone": run(["draft"], args)["draft"]}
        both = run(["target", "draft"], args)
        row["target at once"], row["draft at once"] = both["target"], both["draft"]
        rounds.append(row)
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()), file=sys.stderr)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    report = {"rounds": rounds, "median_ms": med, "tree": args.tree, "load_average_before": load,
              "slowdown": {m: med[f"{m} at once"] / med[f"{m} alone"] for m in ("target", "draft")}}
    print(f"Step time, ms: median of {args.rounds} rounds (min-max); load average before {load:.2f}\n")
    print("| model | alone ms | at once ms | slowdown |")
    print("|---|---:|---:|---:|")
    for m in ("target", "draft"):
        a, b = [r[f"{m} alone"] for r in rounds], [r[f"{m} at once"] for r in rounds]
        print(f"| {m} | {med[f'{m} alone']:.2f} ({min(a):.2f}-{max(a):.2f}) | {med[f'{m} at once']:.2f} "
              f"({min(b):.2f}-{max(b):.2f}) | {report['slowdown'][m]:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
