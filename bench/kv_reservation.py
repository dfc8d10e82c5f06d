"""KV blocks reserved at admission: the worst case (prompt + max_tokens) against a look-ahead.

Pure arithmetic over the bench workloads (bench/workloads/*.jsonl: prompt and output lengths in
tokens), with the gateway's own rule (`Engine.reserve_blocks_for`: + 64 tree-slack tokens, 16-token
blocks) and the target's default pool (4096 blocks, a 4096-token context). For each workload and
look-ahead: mean blocks per request at admission, and how many such requests the default pool
admits at once (pool / mean), with and without max_tokens in the request (without it, the worst
case is the rest of the context). What a look-ahead admits is only what fits at first: requests that
outgrow it are preempted (engine.py), which costs a recompute.

    .venv/bin/python bench/kv_reservation.py
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK, SLACK, POOL, CONTEXT = 16, 64, 4096, 4096
LOOKAHEADS = [0, 16, 64, 256]  # 0: the worst case (today's default)


def blocks(prompt: int, out: int, ahead: int) -> int:
    return math.ceil((prompt + (min(out, ahead) if ahead else out) + SLACK) / BLOCK)


def main() -> None:
    rows = []
    for path in sorted((ROOT / "bench" / "workloads").glob("*.jsonl")):
        reqs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for with_max in (True, False):
            for ahead in LOOKAHEADS:
                per = [blocks(r["prompt_tokens"], r["max_tokens"] if with_max else CONTEXT - r["prompt_tokens"], ahead)
                       for r in reqs]
                mean = statistics.mean(per)
                rows.append({"workload": path.stem, "max_tokens": with_max, "lookahead": ahead,
                             "mean_blocks": round(mean, 1), "fit": int(POOL // max(1.0, mean))})
    print("| workload | max_tokens given | look-ahead | blocks per request | requests the pool admits at once |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        ahead = "worst case" if r["lookahead"] == 0 else f"{r['lookahead']} tokens"
        given = "yes" if r["max_tokens"] else "no"
        print(f"| {r['workload']} | {given} | {ahead} | {r['mean_blocks']} | {r['fit']} |")
    (ROOT / "bench" / "results" / "kv_reservation.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
