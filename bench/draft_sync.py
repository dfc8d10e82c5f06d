"""Keeping the draft's view of committed tokens current: `--draft-sync lazy` against `eager`, side by side.

A request that does not speculate in an iteration (d = 0: AdaServe when the roots use the budget,
chain:K near max_tokens, a policy that turned speculation off) commits tokens the draft has not
seen. `lazy` sends them with the request's next speculation (one catch-up pass then, on the
critical path); `eager` sends them every iteration in a depth-0 Speculate beside the target pass.

The workload makes speculation toggle: waves of `--concurrency` requests with staggered max_tokens
under adaserve with budget B = `--budget`, so the batch shrinks through B as requests finish and
speculation turns on with a backlog. Per mode (order alternating by run, fresh services each
time): wall time, tokens/s, mean TPOT, and from /metrics the draft's catch-up, beam and eager-sync
seconds and the iteration split. Medians (min-max) over runs go to bench/results/draft_sync.json.

    .venv/bin/python bench/draft_sync.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.sweep import relative_paths  # noqa: E402
from specserve.cli.loadgen.scrape import parse_counters  # noqa: E402
from specserve.shared.host.launch import ServiceProcess  # noqa: E402

PROMPTS = [json.loads(line)["prompt"] for line in (ROOT / "bench/workloads/short.jsonl").read_text().splitlines()]
COUNTERS = {
    "catchup_s": "specserve:draft_catchup_seconds_total",
    "beam_s": "specserve:draft_beam_seconds_total",
    "sync_s": "specserve:draft_sync_seconds_total",
    "draft_s": "specserve:iteration_draft_seconds_total",
    "target_s": "specserve:iteration_target_seconds_total",
    "transport_s": "specserve:iteration_transport_seconds_total",
    "schedule_s": "specserve:iteration_schedule_seconds_total",
    "iterations": "specserve:iterations_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}


async def workload(url: str, concurrency: int, waves: int, tokens: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        async def metrics() -> dict[str, float]:
            async with s.get(f"{url}/metrics") as r:
                return parse_counters(await r.text())

        async def one(i: int) -> tuple[int, float]:
            n = max(8, tokens * (i % concurrency + 1) // concurrency)  # staggered: the batch shrinks
            body = {"model": "target", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": n, "temperature": 0,
                    "ignore_eos": True}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                out = await r.json()
            return out["usage"]["completion_tokens"], out["specserve"]["tpot_ms"]

        before = await metrics()
        t0 = time.perf_counter()
        done = []
        for w in range(waves):
            done += await asyncio.gather(*(one(w * concurrency + i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
        after = await metrics()
    d = {k: after.get(v, 0.0) - before.get(v, 0.0) for k, v in COUNTERS.items()}
    total = sum(d[k] for k in ("draft_s", "target_s", "transport_s", "schedule_s"))
    return {"wall_s": wall, "tokens_per_s": sum(n for n, _ in done) / wall,
            "tpot_ms": statistics.mean(t for _, t in done if t is not None), **d,
            "iteration_ms": total / d["iterations"] * 1e3 if d["iterations"] else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="the longest request's max_tokens")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--policy", default="adaserve")
    ap.add_argument("--profile", default=str(ROOT / "bench/results/sweep-full/profile.json"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/draft_sync.json"))
    args = ap.parse_args()
    modes = ["lazy", "eager"]
    rows = []
    for run in range(args.runs):
        for mode in (modes if run % 2 == 0 else modes[::-1]):
            target = ServiceProcess("target", threads=1)
            draft = ServiceProcess("draft", threads=1)
            gateway = ServiceProcess("gateway", "--draft", draft.address, "--target", target.address, "--policy",
                                     args.policy, "--profile", args.profile, "--budget", str(args.budget),
                                     "--draft-sync", mode)
            try:
                r = asyncio.run(workload(gateway.address, args.concurrency, args.waves, args.tokens))
            finally:
                for p in (gateway, draft, target):
                    p.stop()
            rows.append({"run": run, "mode": mode, **r})
            print(f"run {run} {mode}: {r['tokens_per_s']:.1f} tok/s, TPOT {r['tpot_ms']:.2f} ms, catch-up "
                  f"{r['catchup_s']:.3f} s, sync {r['sync_s']:.3f} s", file=sys.stderr, flush=True)
    keys = ["tokens_per_s", "tpot_ms", "wall_s", "iteration_ms", "catchup_s", "beam_s", "sync_s", "draft_s",
            "target_s", "transport_s", "schedule_s", "iterations"]
    summary = {m: {k: {"median": statistics.median(r[k] for r in rows if r["mode"] == m),
                       "min": min(r[k] for r in rows if r["mode"] == m),
                       "max": max(r[k] for r in rows if r["mode"] == m)} for k in keys} for m in modes}
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary, "args": relative_paths(vars(args))},
                                         indent=1))
    print("| | " + " | ".join(modes) + " |")
    print("|---|" + "---:|" * len(modes))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{summary[m][k]['median']:.3f} ({summary[m][k]['min']:.3f}-"
                                       f"{summary[m][k]['max']:.3f})" for m in modes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
