"""Prefix caching's effect on the time to first token, caching on against off, in interleaved rounds.

    .venv/bin/python bench/prefix_cache.py [--rounds 3] [--model smollm2-135m-instruct] [--out FILE]

Two `specserve up` stacks on the same model (`--model`, SmolLM2-135M-Instruct by default, with its own
draft; `--threads` per model service), one with the services' default prefix caching and one with it off
(`SPECSERVE_TARGET_PREFIX_CACHING=0`, `SPECSERVE_DRAFT_PREFIX_CACHING=0`), started once and run side by
side: each round runs both workloads on one stack, then on the other (which goes first alternates),
through the official openai client, greedy, streamed (the TTFT is the first content chunk's arrival):
- `chat`: a 4-turn conversation at concurrency 1, each turn re-sending the whole history (the model's
  own earlier answers, up to --answer-tokens each) and a new user message: about 600 prompt tokens by
  the last turn. Reported: each turn's prompt tokens, the tokens the response says were cached, and its
  TTFT on and off;
- `system`: a shared system prompt of --system-tokens tokens (512) and 8 different short questions sent
  at once (--concurrency), after one request that puts the system prompt in the cache (not timed).
  Reported: the TTFT p50 of the 8, on and off.
Each round's conversation and system prompt begin with the round's own tag, so no round finds an
earlier round's prompts cached. Answers must be the same on and off (greedy; `identical` counts them).
Medians over rounds. Writes bench/results/prefix_cache.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TURNS = [
    "I am planning a small vegetable garden behind my house. The plot gets about six hours of sun a day, the "
    "soil is heavy clay, and I live somewhere with cold winters and warm, fairly dry summers. I have never "
    "grown anything before. Which vegetables would you suggest I start with, and why those?",
    "Thanks. How should I prepare the clay soil before planting? I can spend a weekend on it and a modest amount "
    "of money, but I would rather not rent heavy machinery. Please give me the steps in order.",
    "What watering schedule would you recommend for those vegetables during the dry summer months, and how can I "
    "tell whether I am watering too much or too little? I will be away for a week in July.",
    "Finally, how do I keep slugs, aphids and rabbits away without using strong chemicals? I have a dog and "
    "small children who play in the garden, so anything I use has to be safe for them.",
]
QUESTIONS = ["How do I reset my password?", "Can I change my delivery address after ordering?",
             "What is your refund policy for damaged items?", "Do you ship to Canada?",
             "How long does standard delivery take?", "Can I pay with a gift card and a credit card together?",
             "Why was my order cancelled?", "How do I contact a human agent?"]
SYSTEM_SENTENCES = [
    "You are the customer support assistant of an online shop that sells books, games and small electronics.",
    "Answer politely and briefly, in plain language, and never invent order numbers, prices or dates.",
    "Orders ship from our warehouse within two working days; standard delivery takes three to five days.",
    "Customers may return any item within thirty days for a full refund if it is unused and in its box.",
    "Damaged items are replaced or refunded at the customer's choice, and we pay the return postage.",
    "Passwords are reset from the sign-in page with the link sent to the account's email address.",
    "A delivery address can be changed until the order has been packed; after that, contact the carrier.",
    "We ship to the European Union, the United Kingdom, Canada and the United States.",
    "Gift cards can be combined with one other payment method in the same order.",
    "If you do not know an answer, say so and offer to hand the conversation to a human agent.",
]


def _system_prompt(tok, tag: str, tokens: int, sentences: list[str] = SYSTEM_SENTENCES) -> str:
    """`tag`, then `sentences` (the shop's rules) repeated until the text is `tokens` tokens long (at least)."""
    text, i = tag, 0
    while len(tok(text)["input_ids"]) < tokens:
        text += " " + sentences[i % len(sentences)]
        i += 1
    return text


async def _ask(client, model: str, messages: list[dict], max_tokens: int, **fields) -> dict:
    """One streamed greedy chat completion (`fields`: more arguments of the call, e.g. `service_tier`): its
    text, TTFT and the time of its last text chunk (ms from the send), the usage's prompt, cached and
    completion tokens, its finish reason and the response's `specserve` report."""
    t0 = time.perf_counter()
    ttft, last, parts, usage, finish, report = None, None, [], None, None, None
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True},
                                                  **fields)
    async for chunk in stream:  # (the TTFT: the first chunk with text; an empty answer's: its end)
        if chunk.choices and chunk.choices[0].delta.content:
            last = (time.perf_counter() - t0) * 1e3
            ttft = ttft if ttft is not None else last
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage, report = chunk.usage, (chunk.model_extra or {}).get("specserve")
    details = getattr(usage, "prompt_tokens_details", None)
    ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1e3
    return {"text": "".join(parts), "ttft_ms": ttft, "last_ms": last if last is not None else ttft,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": (details.cached_tokens or 0) if details is not None else 0,
            "completion_tokens": usage.completion_tokens if usage else 0, "finish_reason": finish, "specserve": report}


async def chat(client, model: str, tag: str, answer_tokens: int) -> list[dict]:
    """The 4-turn conversation, one request at a time, each turn re-sending the history."""
    messages: list[dict] = [{"role": "system", "content": f"{tag} You are a helpful gardening assistant."}]
    turns = []
    for user in TURNS:
        messages.append({"role": "user", "content": user})
        out = await _ask(client, model, messages, answer_tokens)
        messages.append({"role": "assistant", "content": out["text"]})
        turns.append(out)
    return turns


async def system(client, model: str, system_prompt: str, concurrency: int, answer_tokens: int) -> list[dict]:
    """One request that puts the system prompt in the cache, then `concurrency` questions at once."""
    def messages(q: str) -> list[dict]:
        return [{"role": "system", "content": system_prompt}, {"role": "user", "content": q}]
    await _ask(client, model, messages("Hello."), 1)
    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(concurrency)]
    return list(await asyncio.gather(*[_ask(client, model, messages(q), answer_tokens) for q in qs]))


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(rounds: list[dict]) -> dict:
    """Per chat turn and for the system-prompt burst: medians over rounds, on and off."""
    out: dict = {"chat": [], "system": {}}
    for t in range(len(TURNS)):
        row = {"turn": t + 1}
        for mode in ("on", "off"):
            runs = [r[mode]["chat"][t] for r in rounds]
            row[mode] = {"ttft_ms": _median([x["ttft_ms"] for x in runs]),
                         "prompt_tokens": _median([x["prompt_tokens"] for x in runs]),
                         "cached_tokens": _median([x["cached_tokens"] for x in runs])}
        out["chat"].append(row)
    for mode in ("on", "off"):
        p50 = [_median([x["ttft_ms"] for x in r[mode]["system"]]) for r in rounds]
        cached = [x["cached_tokens"] for r in rounds for x in r[mode]["system"]]
        out["system"][mode] = {"ttft_p50_ms": _median(p50), "cached_tokens": _median(cached)}
    same = sum(a["text"] == b["text"] for r in rounds for k in ("chat", "system")
               for a, b in zip(r["on"][k], r["off"][k]))
    total = sum(len(r["on"][k]) for r in rounds for k in ("chat", "system"))
    out["identical"] = f"{same}/{total}"
    return out


def table(summary: dict, concurrency: int) -> str:
    lines = ["| chat turn | prompt tokens | cached (on) | TTFT on, ms | TTFT off, ms | off / on |",
             "|---|---|---|---|---|---|"]
    for row in summary["chat"]:
        on, off = row["on"], row["off"]
        lines.append(f"| {row['turn']} | {on['prompt_tokens']:.0f} | {on['cached_tokens']:.0f} | {on['ttft_ms']:.1f} | "
                     f"{off['ttft_ms']:.1f} | {off['ttft_ms'] / on['ttft_ms']:.2f}x |")
    s_on, s_off = summary["system"]["on"], summary["system"]["off"]
    lines += ["", "| shared system prompt | cached per request (on) | TTFT p50 on, ms | TTFT p50 off, ms | off / on |",
              "|---|---|---|---|---|",
              f"| {concurrency} at once | {s_on['cached_tokens']:.0f} | {s_on['ttft_p50_ms']:.1f} | "
              f"{s_off['ttft_p50_ms']:.1f} | {s_off['ttft_p50_ms'] / s_on['ttft_p50_ms']:.2f}x |",
              "", f"answers identical on and off: {summary['identical']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a named model or a directory (`demo`: the "
                    "bundled demo pair, to check that the script runs)")
    ap.add_argument("--draft-model", default=None, help="`up --draft-model` (default: the model's own)")
    ap.add_argument("--policy", default=None, help="`up --policy` (default: up's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each model service")
    ap.add_argument("--answer-tokens", type=int, default=64, help="max_tokens of each answer")
    ap.add_argument("--system-tokens", type=int, default=512, help="length of the shared system prompt, tokens")
    ap.add_argument("--concurrency", type=int, default=8, help="questions sent at once after the system prompt")
    ap.add_argument("--quiet-s", type=float, default=2.0, help="idle seconds before each workload")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefix_cache.json"))
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from specserve.shared.runtime.model_store import MODELS, resolve
    from tests.support.procs import Up

    os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))  # both stacks' services and clients
    model_dir = str(MODELS / "target") if args.model == "demo" else resolve(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    profile = Path(args.out).with_suffix(".profile.json")
    up_args = ["--model", args.model, "--threads", str(args.threads), "--profile", str(profile)]
    up_args += ["--draft-model", args.draft_model] if args.draft_model else []
    up_args += ["--policy", args.policy] if args.policy else []
    off_env = {**os.environ, "SPECSERVE_TARGET_PREFIX_CACHING": "0", "SPECSERVE_DRAFT_PREFIX_CACHING": "0"}
    stacks = {"off": Up(*up_args, timeout_s=900, env=off_env, demo=False)}  # (it measures the profile if missing)
    try:
        stacks["on"] = Up(*up_args, timeout_s=900, demo=False)
        served = "target" if args.model == "demo" else args.model
        rounds = [asyncio.run(_round(r, stacks, served, tok, args)) for r in range(args.rounds)]
    finally:
        for up in stacks.values():
            up.interrupt()
    summary = summarize(rounds)
    result = {"meta": {"model": args.model, "draft_model": args.draft_model, "policy": args.policy,
                       "rounds": args.rounds, "threads": args.threads, "answer_tokens": args.answer_tokens,
                       "system_tokens": args.system_tokens, "concurrency": args.concurrency,
                       "cpu_count": os.cpu_count()},
              "rounds": rounds, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(summary, args.concurrency))
    print(f"\nwrote {args.out}")
    return 0


async def _round(r: int, stacks: dict, model: str, tok, args) -> dict:
    """One round: both workloads on each stack, the stack that goes first alternating by round."""
    import openai

    tag = f"[session {r + 1}-{secrets.token_hex(3)}]"
    system_prompt = _system_prompt(tok, tag, args.system_tokens)
    out: dict = {}
    for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
        client = openai.AsyncOpenAI(base_url=f"{stacks[mode].url}/v1", api_key="unused", max_retries=0, timeout=600)
        async with client:
            await asyncio.sleep(args.quiet_s)
            turns = await chat(client, model, tag, args.answer_tokens)
            await asyncio.sleep(args.quiet_s)
            burst = await system(client, model, system_prompt, args.concurrency, args.answer_tokens)
        out[mode] = {"chat": turns, "system": burst}
        print(f"round {r + 1} {mode:3s}: chat TTFT " + " ".join(f"{t['ttft_ms']:.0f}" for t in turns)
              + f" ms (cached {[t['cached_tokens'] for t in turns]}); system p50 "
              f"{_median([x['ttft_ms'] for x in burst]):.0f} ms", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
