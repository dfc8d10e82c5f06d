"""A quick side-by-side of the speculation policies through the whole stack (not the issue-6 harness).

One target and one draft service (1 thread each), and for every policy a gateway on them. Two
workloads, each repeated --runs times with the policies interleaved:
  - solo: one request at a time (greedy, 64 tokens) over 6 prompts: mean TPOT;
  - mixed: 12 concurrent requests, tiers critical / search / chat in turn: per request TPOT vs its
    class's SLO (attainment), goodput (tokens/s of requests that met their SLO), throughput.
Prints a markdown table of medians over runs (min-max in brackets).

    .venv/bin/python bench/policy_quick.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specserve.shared.host.launch import ServiceProcess  # noqa: E402

SHORT = [json.loads(line)["prompt"] for line in (ROOT / "bench/workloads/short.jsonl").read_text().splitlines()]
PROMPTS = [SHORT[i] for i in (1, 2, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15)]
TIERS = ["critical", "search", "chat"]


async def solo(url: str, tokens: int) -> dict:
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    tpots = []
    for p in PROMPTS[:6]:
        r = await c.completions.create(model="target", prompt=p, max_tokens=tokens, temperature=0)
        tpots.append(r.model_extra["specserve"]["tpot_ms"])
    await c.close()
    return {"solo_tpot_ms": statistics.mean(tpots)}


async def mixed(url: str, tokens: int, slo: dict) -> dict:
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    rs = await asyncio.gather(*[c.completions.create(model="target", prompt=p, max_tokens=tokens, temperature=0,
                                                     extra_body={"service_tier": TIERS[i % 3]})
                                for i, p in enumerate(PROMPTS)])
    wall = time.perf_counter() - t0
    await c.close()
    met, good, total, acc_steps = 0, 0, 0, []
    per_tier = {t: [] for t in TIERS}
    for i, r in enumerate(rs):
        ext = r.model_extra["specserve"]
        ok = ext["tpot_ms"] is None or ext["tpot_ms"] <= slo[TIERS[i % 3]]
        per_tier[TIERS[i % 3]].append(ext["tpot_ms"])
        met += ok
        total += r.usage.completion_tokens
        good += r.usage.completion_tokens if ok else 0
        acc_steps += [1 + a for _, _, a in ext["steps"]]
    return {"attain": met / len(rs), "goodput": good / wall, "throughput": total / wall,
            "tokens_per_step": statistics.mean(acc_steps) if acc_steps else 1.0,
            **{f"tpot_{t}": statistics.mean(v) for t, v in per_tier.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--policies", default="none,chain:4,tree:1,1,3,1,1,1,1,1,adaserve,equal-greedy,global-greedy")
    ap.add_argument("--profile", required=True, help="profile file (budget B, baseline)")
    ap.add_argument("--gateway-args", default="")
    args = ap.parse_args()
    names = []
    for part in args.policies.split(","):  # re-join "tree:1,1,3,..." which contains commas
        if names and names[-1].startswith("tree:") and part.isdigit():
            names[-1] += "," + part
        else:
            names.append(part)
    target = ServiceProcess("target", threads=1)
    draft = ServiceProcess("draft", threads=1)
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for run in range(args.runs):
            for name in names:
                g = ServiceProcess("gateway", "--draft", draft.address, "--target", target.address, "--policy", name,
                                   "--profile", args.profile, *args.gateway_args.split())
                try:
                    import urllib.request

                    slo = json.load(urllib.request.urlopen(f"{g.address}/v1/slo_classes"))
                    classes = {k: v["tpot_ms"] for k, v in slo["classes"].items()}
                    row = asyncio.run(solo(g.address, args.tokens))
                    row |= asyncio.run(mixed(g.address, args.tokens, classes))
                    results[name].append(row)
                    print(f"run {run} {name}: {row}", file=sys.stderr, flush=True)
                finally:
                    g.stop()
    finally:
        draft.stop()
        target.stop()
    print(f"SLO classes (TPOT ms): {classes}; budget B = {slo['budget_tokens']}; "
          f"baseline {slo['baseline_iteration_ms']} ms")
    keys = ["solo_tpot_ms", "attain", "goodput", "throughput", "tokens_per_step",
            "tpot_critical", "tpot_search", "tpot_chat"]
    print("| policy | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, rows in results.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in rows]
            cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
