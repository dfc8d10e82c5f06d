"""What the stack costs per iteration beside the target's pass, and speculation at a known acceptance.

    .venv/bin/python bench/step_overhead.py [--rounds 3] [--inflight 1,16,64,256] [--seconds 15]
                                            [--replay-alpha 0.8] [--skip-replay] [--staggered]
                                            [--out FILE]

Part 1, the stack's own time: a near-null target (the bundled demo draft, 2 layers of 160, served as the
target, so the pass is a fraction of a millisecond) under `none`, at each number of requests in flight
(closed loop: every client sends its next request when one ends; greedy, `ignore_eos`, 64 new tokens,
a 16-token prompt), served by the stack's own gateway with `--async-scheduling off` and by a second one
with it on (`none+ahead`: each pass planned and sent while the one before runs; the default, auto, is
off on a CPU target and on on a GPU). Per level, over a steady window:
the iteration's wall time (the window's wall time over the gateway's iterations; `counted_ms` is the
sum of its counters' draft, target, transport and scheduling seconds over them, which leaves out the
loop's turns between iterations), the target's model pass (`specserve:iteration_pass_seconds`), and
the rest, the stack's own, in total and per request in flight; of the stack, the part inside the target
service around its pass (checks, inputs, acceptance, the reply). Then the default policy at the largest
level below 100 (its pairing for that model, the demo draft), with `--async-scheduling` off and on,
against `none`, as tokens/s; and both again (`none-loose`, `joint-loose`, the flag at its default, auto)
with a chat TPOT SLO that no step comes near (`LOOSE_TPOT_MS`). The SLO classes scale with the profiled
baseline, a fraction of a millisecond here, so chat's 8x is a few milliseconds: at 64 in flight a step
takes about that long, the SLOs bind in the admission and in the default's choice of who drafts, and the
default trades tokens for SLOs met; the loose pair shows what the policy's own work costs beside `none`.
With `--staggered`, both pairs again (`-staggered` modes) with each request asking for 64 +- 32 new tokens
(seeded per round): in the loop above every request asks for 64, so under `none` the batch runs in step (its
prompts all go in one pass, then 63 passes of plain decodes), which a request that drafts a step breaks for
good (it ends a pass earlier; its successor's prompt then goes in beside the others' decodes); served traffic
is never in step.

Part 2, the replay draft (services/draft/replay.py) on SmolLM2-135M-Instruct at one request: the
target's greedy outputs on the chat prompts of bench/smollm2_c1.py are recorded in this process
(`record_greedy`: the served pass's kernels), then served with `--draft-model replay:FILE`
at alpha A under `chain:4` and under `none`. Reported: tokens per target pass, tokens/s and the speedup,
against the prediction from the measured pass times (the gateway's counters in the same round): E[tokens
per pass] = 1 + A + ... + A^4 times `none`'s iteration over (the chain's target pass + `none`'s rest of an
iteration), i.e. what speculation should give if the draft call and the tree cost nothing beyond the
target's longer pass.

Every mode runs in each round, rounds interleaved; medians over rounds with min-max. Figures: the
report's section 6, Overheads (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.sweep import spread  # noqa: E402

NEW_TOKENS = 64
STAGGER = 32  # `--staggered`: each request's new tokens drawn from NEW_TOKENS +- STAGGER (seeded)
LOOSE_TPOT_MS = 1000.0  # the `-loose` gateways' chat TPOT: no step at these loads comes near it
PROMPT = list(range(100, 116))  # 16 token ids, valid in both bundled vocabularies and SmolLM2's


async def closed_loop(url: str, inflight: int, seconds: float, prompt: list[int], max_tokens: int,
                      stagger: int = 0, seed: int = 0) -> dict:
    """`inflight` clients for `seconds` (after a warm-up of one request each); the gateway's counters over
    the steady window, the tokens the clients received in it, and of the requests ended in it the share
    that met both SLOs (the response's `specserve.slo_met`) and their tokens per second. stagger > 0: each
    request asks for max_tokens +- stagger new tokens (uniform, drawn from `seed`), so that requests end and
    start at different iterations, as in served traffic, rather than all together."""
    import random

    import aiohttp

    from specserve.cli.loadgen.scrape import scrape, server_delta

    tokens, met, ended, good = 0, 0, 0, 0
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        draw = random.Random(seed)
        body = {"model": model, "prompt": prompt, "temperature": 0, "ignore_eos": True}

        async def one() -> tuple[int, bool]:
            length = max_tokens + draw.randint(-stagger, stagger) if stagger else max_tokens
            async with session.post(f"{url}/v1/completions", json={**body, "max_tokens": length}) as resp:
                resp.raise_for_status()
                out = await resp.json()
                return int(out["usage"]["completion_tokens"]), bool(out["specserve"]["slo_met"])

        await asyncio.gather(*[one() for _ in range(inflight)])  # warm-up: shapes, profiles, caches
        stop_at = time.monotonic() + seconds

        async def client() -> None:
            nonlocal tokens, met, ended, good
            while time.monotonic() < stop_at:
                received, slo_met = await one()  # not `tokens += ...`: that reads `tokens` before the await
                tokens, ended, met = tokens + received, ended + 1, met + slo_met
                good += received if slo_met else 0

        before = await scrape(session, url)
        start = time.monotonic()
        await asyncio.gather(*[client() for _ in range(inflight)])
        wall = time.monotonic() - start
        after = await scrape(session, url)
    delta = server_delta(before, after)
    split = iteration_split(delta["iteration"], wall)
    return {"inflight": inflight, **split, "stack_us_per_request": split["stack_ms"] * 1e3 / inflight,
            "tokens_per_s": tokens / wall, "tokens_per_pass": delta["mean_acceptance_length"],
            "slo_met": met / ended if ended else None, "good_tokens_per_s": good / wall}


def iteration_split(it: dict, wall_s: float | None = None) -> dict:
    """server_delta's iteration part as ms per iteration: the whole, the target's model pass, the rest (the
    stack's), and of the stack the target service's own work around its pass (checks, inputs, acceptance).
    With `wall_s` (the window's wall time) the whole is the wall time over the iterations: what the
    counters' parts leave out (the loop's turns between iterations) counts, and a pass sent ahead
    (--async-scheduling), whose call overlaps the next iteration, does not count twice; `counted_ms` keeps
    the sum of the counters' parts."""
    n = max(it["iterations"], 1)
    counted_ms = it["mean_ms"] or 0.0
    iteration_ms = wall_s * 1e3 / n if wall_s is not None and it["iterations"] else counted_ms
    pass_ms = it["pass_seconds"] / n * 1e3
    return {"iterations": it["iterations"], "iteration_ms": iteration_ms, "counted_ms": counted_ms,
            "target_ms": pass_ms, "stack_ms": iteration_ms - pass_ms,
            "target_service_ms": it["seconds"]["target"] / n * 1e3 - pass_ms,
            "split_ms": {p: s / n * 1e3 for p, s in it["seconds"].items()}}


def near_null(args: argparse.Namespace, levels: list[int], up_args: tuple[str, ...] = ()) -> list[dict]:
    """Part 1: one stack on the near-null target, a gateway per policy; `rounds` interleaved rounds.
    up_args: more flags for `specserve up` (bench/gpu_suite.py's `--device cuda --dtype bfloat16`)."""
    from specserve.shared.runtime.model_store import MODELS
    from tests.support.procs import Up, gateway

    model = str(MODELS / "draft")
    profile = Path(tempfile.mkdtemp()) / "profile.json"
    up = Up("--model", model, "--draft-model", model, "--policy", "none", "--threads", "1",
            "--profile", str(profile), *up_args, "--", "--async-scheduling", "off", timeout_s=600)
    own = ("--model", model, "--profile", str(profile), "--async-scheduling")
    loose = ("--slo-class", f"chat={LOOSE_TPOT_MS:g}")  # requests carry no tier: chat
    gateways = {"none+ahead": gateway(up, "none", *own, "on"), "joint": gateway(up, "joint", *own, "off"),
                "joint+ahead": gateway(up, "joint", *own, "on"),
                "none-loose": gateway(up, "none", *own, "auto", *loose),
                "joint-loose": gateway(up, "joint", *own, "auto", *loose)}
    duel = max([n for n in levels if n < 100] or [levels[0]])
    rounds = []
    try:
        for r in range(args.rounds):
            row = {}
            for n in levels:
                row[f"none@{n}"] = asyncio.run(closed_loop(up.url, n, args.seconds, PROMPT, NEW_TOKENS))
                row[f"none+ahead@{n}"] = asyncio.run(closed_loop(gateways["none+ahead"].address, n, args.seconds,
                                                                 PROMPT, NEW_TOKENS))
            for name in ("joint", "joint+ahead", "none-loose", "joint-loose"):
                row[f"{name}@{duel}"] = asyncio.run(closed_loop(gateways[name].address, duel, args.seconds, PROMPT,
                                                                NEW_TOKENS))
            if getattr(args, "staggered", False):  # (bench/gpu_suite.py's namespace has no such flag)
                urls = {"none": up.url, **{name: gateways[name].address for name in ("joint", "none-loose",
                                                                                      "joint-loose")}}
                for name, url in urls.items():
                    row[f"{name}-staggered@{duel}"] = asyncio.run(closed_loop(url, duel, args.seconds, PROMPT,
                                                                              NEW_TOKENS, STAGGER, seed=r))
            rounds.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v['stack_ms']:.2f} ms stack, {v['tokens_per_s']:.0f} tok/s"
                                                 for k, v in row.items()), flush=True)
    finally:
        for g in gateways.values():
            g.stop()
        up.interrupt()
    return rounds


def replay(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Part 2: SmolLM2 at one request under `none` and `chain:4` with the replay draft."""
    from transformers import AutoTokenizer

    from bench.smollm2_c1 import CHAT, _ids
    from specserve.draft.replay import record_greedy
    from specserve.shared.runtime.model_store import resolve
    from tests.support.procs import Up, gateway

    model_dir = resolve("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [_ids(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
               for p in CHAT]
    work = Path(tempfile.mkdtemp())
    recording, profile = work / "replay.json", work / "profile.json"
    record_greedy(model_dir, prompts, args.replay_tokens, args.replay_alpha, 0, recording)
    up = Up("--model", "smollm2-135m-instruct", "--draft-model", f"replay:{recording}", "--policy", "none",
            "--threads", "1", "--profile", str(profile), timeout_s=900)
    chain = gateway(up, "chain:4", "--model", model_dir, "--profile", str(profile))
    rounds = []
    try:
        for r in range(args.rounds):
            row = {}
            for name, url in (("none", up.url), ("chain:4", chain.address)):
                row[name] = _sequential(url, prompts, args.replay_tokens)
            rounds.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v['tokens_per_s']:.1f} tok/s, {v['tokens_per_pass']:.2f} "
                                                 "tokens/pass" for k, v in row.items()), flush=True)
    finally:
        chain.stop()
        up.interrupt()
    alpha = args.replay_alpha
    expected = sum(alpha ** k for k in range(5))
    predicted = [expected * r["none"]["iteration_ms"] / (r["chain:4"]["target_ms"] + r["none"]["stack_ms"])
                 for r in rounds]
    return rounds, {"alpha": alpha, "expected_tokens_per_pass": expected, "predicted_speedup": spread(predicted)}


def _sequential(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Each prompt once, one at a time: tokens/s over the whole set, tokens per target pass, and the
    iteration's split from the gateway's counters (ms per iteration: the target's pass, the rest)."""
    import httpx

    from specserve.cli.loadgen.scrape import parse_counters, server_delta

    tokens, steps = 0, []
    with httpx.Client(base_url=url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        before = parse_counters(client.get("/metrics").text)
        start = time.perf_counter()
        for p in prompts:
            out = client.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                       "temperature": 0}).json()
            tokens += out["usage"]["completion_tokens"]
            steps += out["specserve"]["steps"]  # [.., nodes, accepted drafts] per verify step
        wall = time.perf_counter() - start
        it = server_delta(before, parse_counters(client.get("/metrics").text))["iteration"]
    return {"tokens_per_s": tokens / wall, **iteration_split(it),
            "tokens_per_pass": sum(1 + a for _, _, a in steps) / len(steps) if steps else 1.0}


def _print(result: dict) -> None:
    """The medians (min-max) as a table."""
    def fmt(x: dict, digits: int = 2) -> str:
        return f"{x['median']:.{digits}f} ({x['min']:.{digits}f}-{x['max']:.{digits}f})"

    for mode, m in result.get("near_null", {}).get("median", {}).items():
        print(f"{mode:>16}: iteration {fmt(m['iteration_ms'])} ms, target pass {fmt(m['target_ms'])} ms, stack "
              f"{fmt(m['stack_ms'])} ms = {fmt(m['stack_us_per_request'], 0)} us a request (the target service's "
              f"own {fmt(m['target_service_ms'])} ms), "
              f"{fmt(m['tokens_per_s'], 0)} tok/s, {fmt(m['good_tokens_per_s'], 0)} of them within both SLOs")
    if "replay" in result:
        r = result["replay"]
        print(f"replay, alpha {r['prediction']['alpha']}: chain:4 / none {fmt(r['speedup'])}, "
              f"{fmt(r['tokens_per_pass'])} tokens/pass; predicted {fmt(r['prediction']['predicted_speedup'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inflight", default="1,16,64,256")
    parser.add_argument("--seconds", type=float, default=15.0, help="steady window per level")
    parser.add_argument("--replay-alpha", type=float, default=0.8)
    parser.add_argument("--replay-tokens", type=int, default=96)
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--skip-near-null", action="store_true")
    parser.add_argument("--staggered", action="store_true",
                        help=f"the default-against-none duels again with each request's length drawn from "
                             f"{NEW_TOKENS} +- {STAGGER} tokens (`-staggered` modes)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_overhead.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))  # up's services and our gateways share it
    levels = [int(x) for x in args.inflight.split(",")]
    result: dict = {"rounds": args.rounds, "seconds": args.seconds}
    if not args.skip_near_null:
        rounds = near_null(args, levels)
        result["near_null"] = {"rounds": rounds, "median": {
            k: {m: spread([r[k][m] for r in rounds]) for m in ("iteration_ms", "counted_ms", "target_ms", "stack_ms",
                                                                "target_service_ms", "stack_us_per_request",
                                                                "tokens_per_s", "good_tokens_per_s")}
            for k in rounds[0]}}
    if not args.skip_replay:
        rounds, prediction = replay(args)
        speedups = [r["chain:4"]["tokens_per_s"] / r["none"]["tokens_per_s"] for r in rounds]
        result["replay"] = {"rounds": rounds, "prediction": prediction, "speedup": spread(speedups),
                            "tokens_per_pass": spread([r["chain:4"]["tokens_per_pass"] for r in rounds])}
    Path(args.out).write_text(json.dumps(result, indent=1))
    _print(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
