"""What returning the target's features costs: a Forward with `features=True` against one without, in turns.

    .venv/bin/python bench/eagle_features.py [--rounds 5] [--steps 40] [--threads 1]

SmolLM2-135M-Instruct's TargetEngine in this process (the compiled CPU pass, as the target service runs
it), one request: a 128-token prompt, then --steps verification steps of a 5-node chain of fixed
tokens (rarely accepted: about one feature row per step), each step once with and once without
features, alternating. Reported: the median of the rounds' median step times (min-max) both ways, their
ratio, and the bytes the features add to a reply (float32 rows of the hidden size, one per accepted
path node, root included; the prompt's chunk returns one row per token). The socket's share is not in
it: a reply of a few KB more over a local socket.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.sweep import spread  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "eagle_features.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from specserve.shared.runtime.model_store import resolve
    from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec, VerifyEntry
    from specserve.target.config import TargetConfig
    from specserve.target.engine import TargetEngine

    engine = TargetEngine(TargetConfig(model=resolve("smollm2-135m-instruct"), kv_blocks=512))
    greedy = SamplingSpec(0.0, 1.0, 0, None)
    prompt = [(i * 7919) % 40000 + 100 for i in range(128)]
    rounds, reply_rows = [], []
    for r in range(args.rounds):
        times: dict[bool, list[float]] = {False: [], True: []}
        rids = {flag: f"r{r}-{int(flag)}" for flag in (False, True)}
        last = {}
        for flag, rid in rids.items():
            _, out = engine.forward(Forward([PrefillEntry(rid, 0, 0, len(prompt), True, greedy)], [], features=flag),
                                    {"prefill_tokens": torch.tensor(prompt, dtype=torch.int32)})
            last[flag] = int(out["tokens"][-1])
        for step in range(1, args.steps + 1):
            for flag, rid in rids.items():
                committed = engine.requests[rid].committed
                chain = [last[flag], 11, 12, 13, 14]
                msg = Forward([], [VerifyEntry(rid, step, committed, len(chain))], features=flag)
                t0 = time.perf_counter()
                reply, out = engine.forward(msg, {"tree_tokens": torch.tensor(chain, dtype=torch.int32),
                                                  "tree_parents": torch.tensor([-1, 0, 1, 2, 3], dtype=torch.int32)})
                times[flag].append(time.perf_counter() - t0)
                last[flag] = int(out["tokens"][-1])
                if flag:
                    reply_rows.append(reply.results[0].num_features)
        for rid in rids.values():
            engine.release(rid)
        rounds.append({k: statistics.median(v) * 1e3 for k, v in ((("with" if f else "without"), t)
                                                                 for f, t in times.items())})
        print(f"round {r + 1}: without {rounds[-1]['without']:.2f} ms, with {rounds[-1]['with']:.2f} ms", flush=True)
    hidden = engine.runner.model.config.hidden_size
    out = {"meta": {"rounds": args.rounds, "steps": args.steps, "threads": args.threads, "chain_nodes": 5,
                    "prompt_tokens": len(prompt), "hidden": hidden},
           "without_ms": spread([r["without"] for r in rounds]), "with_ms": spread([r["with"] for r in rounds]),
           "ratio": spread([r["with"] / r["without"] for r in rounds]),
           "bytes_per_row": hidden * 4, "mean_rows_per_step": statistics.mean(reply_rows),
           "prefill_bytes": hidden * 4 * len(prompt)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
