"""SLO attainment of multi-turn conversations with prefix caching on against off, over 2 target replicas.

    .venv/bin/python bench/prefix_slo.py [--rates 0.3,0.4] [--rounds 3] [--duration-s 35] [--out FILE]

The target: under a multi-turn SLO mix, at the rate where FIFO admission meets 50 % of the SLOs, the
default (SLO admission, prefix-aware pricing and routing) with prefix caching on meets >= 1.3x the SLOs
of the same default with caching off. An SLO is met only when both its TTFT and its TPOT are; a refused
request (503) counts as missed (specserve.cli.loadgen.records, bench/admission.py's outcomes).

Three `specserve up --targets 2` stacks on the same model (`--model`, SmolLM2-135M-Instruct by default,
with its own draft; `--threads` per model service; one profile, `--profile`, by default beside `--out`, measured
by the first stack when missing), started once and run side by side, the arms:
- `on`: the default (policy, SLO admission, router) with the services' default prefix caching;
- `off`: the same with caching off (`SPECSERVE_TARGET_PREFIX_CACHING=0`, `SPECSERVE_DRAFT_PREFIX_CACHING=0`);
- `fifo`: caching off and `--admission fifo` (the project's no-SLO-admission arm), which locates the rate.
Each round runs every rate of `--rates` on every arm, the same conversations on each (same seed, same
tag), the arm that goes first rotating with the round and the rate; every point's prompts begin with
that point's own tag, so no point finds an earlier point's prompts cached.

The workload: conversations start as a Poisson process at the rate (conversations/s) for `--duration-s`;
each has `--turns` turns (4), each turn re-sending the whole history (the model's own earlier answers,
greedy, up to `--answer-tokens` each) and a new user message, the next turn sent `--think-s` after the
previous answer ended. A refused or failed turn counts as missed and its message is left out of the
history; the conversation goes on. Two kinds, each with a system prompt shared by every conversation of
that kind within a point (bench/prefix_cache.py's texts): `support` (an online shop's rules,
`--system-tokens` long, questions from its customers; the `interactive` tier, sent as `critical`) and
`garden` (a gardening assistant, a quarter as long a system prompt, longer questions; the `chat` tier),
`--interactive-share` of the conversations the first. Every request carries its SLO explicitly
(`service_tier` and `slo: {ttft_ms, tpot_ms}`, docs/usage.md).

The SLOs are multiples of what a request gets alone: before the rounds, one conversation of each kind
runs alone on the `fifo` stack (caching off, nothing else running); the base TTFT is the median TTFT of
its turns and the base TPOT the median TPOT. The interactive tier's SLO is `--ttft-x` / `--tpot-x`'s
first value times the base (2x, 1.5x), the chat tier's the second (4x, 3x). `--base-ttft-ms` and
`--base-tpot-ms` give the base instead (the same SLOs as an earlier run).

Reported per arm and rate (median and range over `--rounds`): attainment (both SLOs; TTFT and TPOT
alone beside it), goodput (output tokens/s of the requests that met both), refused and failed requests,
prompt and cached tokens; the ratio of attainment on / off per round with its median and range; the grid
rate where FIFO's median attainment is nearest 50 % and the ratio there. Every point checks that every
request ended (`lost`: planned turns neither served nor refused) and that every KV block was free afterwards.
Writes bench/results/prefix_slo.json (or --out; the report links it compressed, .json.xz) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import admission  # noqa: E402
from prefix_cache import QUESTIONS, SYSTEM_SENTENCES, TURNS, _ask, _system_prompt  # noqa: E402
from sweep import ROOT, machine_info, relative_paths, spread  # noqa: E402

from specserve.cli.loadgen.arrivals import poisson_arrivals  # noqa: E402
from specserve.cli.loadgen.client import apply_report  # noqa: E402
from specserve.cli.loadgen.records import RequestRecord, summarize, vllm_tpot_ms  # noqa: E402

OUT = ROOT / "bench" / "results" / "prefix_slo.json"
OFF = {"SPECSERVE_TARGET_PREFIX_CACHING": "0", "SPECSERVE_DRAFT_PREFIX_CACHING": "0"}
ARMS = {"on": ({}, []), "off": (OFF, []), "fifo": (OFF, ["--", "--admission", "fifo"])}  # (env, up's args)
FIGURES = ("attainment", "ttft_attainment", "tpot_attainment", "goodput_tok_s", "refused", "failed", "lost",
           "prompt_tokens", "cached_tokens", "ttft_p50_ms", "tpot_p50_ms")
GOAL = 1.3  # the target: on / off attainment at FIFO's 50 % rate


@dataclass(frozen=True, slots=True)
class Kind:
    tier: str  # the SLO tier of its conversations
    service_tier: str  # sent as service_tier
    system: list[str]  # sentences of its shared system prompt
    system_scale: float  # its system prompt's length, a share of --system-tokens
    intro: str  # the first message's opening, formatted with a seeded number and place
    questions: list[str]  # its user turns are drawn from these


GARDEN_SYSTEM = [
    "You are a friendly gardening assistant for beginners who grow vegetables at home.",
    "Give practical, concrete advice in plain language, in a few short steps where steps help.",
    "Prefer cheap, safe methods, and say so when something depends on the local climate or soil.",
]
PLACES = ["a small town in the north", "the outskirts of a large city", "a windy coastal village",
          "a valley in the mountains", "a dry plain far from the sea", "a rainy river delta"]
KINDS = {
    "support": Kind("interactive", "critical", SYSTEM_SENTENCES, 1.0,
                    "Hello, my order number is {number}.", QUESTIONS),
    "garden": Kind("chat", "chat", GARDEN_SYSTEM, 0.25, "Hi, I live in {place}.", [
                   TURNS[0], TURNS[1].removeprefix("Thanks. "), TURNS[2], "H" + TURNS[3].removeprefix("Finally, h"),
                   "Which of those vegetables can I grow in large pots on a sunny balcony instead, and how big "
                   "should the pots be? I would also like to try some herbs for cooking.",
                   "How do I make my own compost from kitchen scraps and garden waste, and how long does it take "
                   "before I can use it on the beds?",
                   "When should I harvest tomatoes, beans and carrots, and how can I tell that each one is ready? "
                   "I do not want to pick them too early or leave them too long.",
                   "What should I do in the autumn to prepare the garden for winter, so that it is ready to "
                   "plant again in the spring?"]),
}


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    kind: str
    start_s: float  # when its first turn is sent, from the point's start
    system: str
    users: list[str]  # its user messages, one per turn


class TurnRecord(RequestRecord, kw_only=True):
    """One turn as the client saw it: the load generator's record plus where it sits and what was cached."""

    conversation: int
    turn: int
    cached_tokens: int = 0
    replica: int | None = None  # the target replica that served it (the `specserve` report's)


def conversations(n: int, rate: float, seed: int, systems: dict[str, str], turns: int,
                  interactive_share: float) -> list[Conversation]:
    """`n` conversations at `rate` per second (Poisson), `interactive_share` of them `support`, seeded."""
    rng = random.Random(seed)
    k = round(n * interactive_share)
    kinds = ["support"] * k + ["garden"] * (n - k)
    rng.shuffle(kinds)
    out = []
    for i, (start, name) in enumerate(zip(poisson_arrivals(n, rate, seed), kinds)):
        kind = KINDS[name]
        users = rng.sample(kind.questions, turns)
        intro = kind.intro.format(number=rng.randint(10000, 99999), place=rng.choice(PLACES))
        out.append(Conversation(i, name, start, systems[name], [f"{intro} {users[0]}", *users[1:]]))
    return out


async def _turn(client, model: str, messages: list[dict], conv: Conversation, turn: int, slo: dict | None,
                args: argparse.Namespace, t0: float) -> tuple[TurnRecord, str]:
    """One turn, streamed: its record and its answer's text ('' when it was refused or failed)."""
    import openai

    kind = KINDS[conv.kind]
    sent = time.perf_counter() - t0
    rec = TurnRecord(index=0, category=kind.tier, workload=conv.kind, prompt_id=f"{conv.index}-{turn}",
                     slo_tpot_ms=slo["tpot_ms"] if slo else math.inf, slo_ttft_ms=slo["ttft_ms"] if slo else math.inf,
                     scheduled_s=sent, sent_s=sent, max_tokens=args.answer_tokens, conversation=conv.index, turn=turn)
    fields = {"service_tier": kind.service_tier, "extra_body": {"slo": slo}} if slo else {}
    try:
        out = await _ask(client, model, messages, args.answer_tokens, **fields)
    except openai.APIStatusError as exc:  # refused before any byte (503 with Retry-After), or rejected
        rec.status, rec.error = exc.status_code, exc.message
        retry = exc.response.headers.get("retry-after")
        rec.retry_after_s = float(retry) if retry is not None else None
        return rec, ""
    except openai.APIError as exc:  # the connection, a timeout, an error in the stream
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec, ""
    rec.status, rec.ttft_ms, rec.latency_ms = 200, out["ttft_ms"], out["last_ms"]
    rec.prompt_tokens, rec.completion_tokens = out["prompt_tokens"] or 0, out["completion_tokens"]
    rec.cached_tokens, rec.finish_reason = out["cached_tokens"], out["finish_reason"]
    rec.tpot_ms = vllm_tpot_ms(rec.ttft_ms, rec.latency_ms, rec.completion_tokens)
    if out["specserve"]:
        apply_report(out["specserve"], rec)  # (the SLO the server judged it by: the one it was sent)
        rec.replica = out["specserve"].get("replica")
    if rec.finish_reason is None:
        rec.error = "the stream ended without a finish_reason"
    return rec, out["text"]


async def converse(client, model: str, conv: Conversation, slo: dict, args: argparse.Namespace, t0: float,
                   records: list[TurnRecord]) -> None:
    """A conversation's turns, each re-sending the history; a refused turn's message is left out of it."""
    await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
    messages = [{"role": "system", "content": conv.system}]
    for turn, user in enumerate(conv.users, 1):
        messages.append({"role": "user", "content": user})
        rec, text = await _turn(client, model, messages, conv, turn, slo.get(KINDS[conv.kind].tier), args, t0)
        records.append(rec)
        if rec.ok:
            messages.append({"role": "assistant", "content": text})
        else:
            messages.pop()
        if turn < len(conv.users) and args.think_s > 0:
            await asyncio.sleep(args.think_s)


async def drive(url: str, model: str, convs: list[Conversation], slo: dict, args: argparse.Namespace,
                one_at_a_time: bool = False) -> tuple[list[TurnRecord], float]:
    """Every conversation through the official openai client; (records in send order, first send to last end, s)."""
    import openai

    records: list[TurnRecord] = []
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=args.timeout_s) as client:
        t0 = time.perf_counter()
        if one_at_a_time:
            for conv in convs:  # (their start_s: 0)
                await converse(client, model, conv, slo, args, t0, records)
        else:
            await asyncio.gather(*(converse(client, model, c, slo, args, t0, records) for c in convs))
        end = time.perf_counter() - t0
    records.sort(key=lambda r: r.sent_s)
    for i, r in enumerate(records):
        r.index = i
    return records, end - min((r.sent_s for r in records), default=0.0)


def point_summary(records: list[TurnRecord], duration_s: float, planned: int) -> dict:
    """The load generator's summary trimmed as bench/admission.py trims it (both SLOs; refused = missed),
    with the tokens cached, the turns that ended and each turn's row."""
    full = summarize(records, duration_s)
    out = admission.slim(full, records)
    failed = out["outcomes"]["failed"]  # (neither served nor refused: an error, a timeout, a cut stream)
    return out | {"tpot_attainment": full["tpot_attainment"], "failed": failed,
                  "planned": planned, "lost": planned - len(records) + failed,
                  "prompt_tokens": sum(r.prompt_tokens for r in records),
                  "cached_tokens": sum(r.cached_tokens for r in records),
                  "records": [{"conversation": r.conversation, "turn": r.turn, "tier": r.category,
                               "outcome": admission.outcome(r), "status": r.status, "sent_s": round(r.sent_s, 3),
                               "ttft_ms": _round(r.ttft_ms), "tpot_ms": _round(r.tpot_ms),
                               "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                               "completion_tokens": r.completion_tokens, "replica": r.replica, "error": r.error}
                              for r in records]}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


# ------------------------------------------------------------------------------------------ stacks and SLOs


def start_stacks(args: argparse.Namespace) -> dict:
    """One `up` per arm: `fifo` first (it measures the profile if the file is missing), then the others
    side by side."""
    from tests.support.procs import Up

    up_args = ["--model", args.model, "--targets", str(args.targets), "--threads", str(args.threads)]
    up_args += ["--profile", args.profile or str(Path(args.out).with_suffix(".profile.json"))]
    up_args += ["--policy", args.policy] if args.policy else []

    def start(arm: str):
        env, extra = ARMS[arm]
        return Up(*up_args, *extra, timeout_s=900, env={**os.environ, **env}, demo=False)

    stacks = {"fifo": start("fifo")}
    try:
        with ThreadPoolExecutor(len(ARMS) - 1) as pool:
            futures = {arm: pool.submit(start, arm) for arm in ARMS if arm != "fifo"}
        stacks |= {arm: f.result() for arm, f in futures.items() if f.exception() is None}
        for f in futures.values():
            f.result()  # (raises the first failure)
    except BaseException:
        stop_stacks(stacks)
        raise
    return stacks


def stop_stacks(stacks: dict) -> None:
    for up in stacks.values():
        up.interrupt()


def idle(up) -> bool:
    """Whether every service of `up` holds no request and no KV block (cached blocks count as free) within 30 s."""
    from tests.support.gateway import wait_all_free

    try:
        wait_all_free(up, 30)
    except AssertionError:
        return False
    return True


def system_prompts(tok, tag: str, tokens: int) -> dict[str, str]:
    """Each kind's system prompt, beginning with `tag`: `tokens` x its scale long."""
    return {name: _system_prompt(tok, tag, round(tokens * k.system_scale), k.system) for name, k in KINDS.items()}


def calibrate(url: str, model: str, tok, args: argparse.Namespace) -> dict:
    """One conversation of each kind alone, no SLO sent: the base TTFT and TPOT (medians over its turns)."""
    systems = system_prompts(tok, f"[calibrate-{secrets.token_hex(3)}]", args.system_tokens)
    convs = [Conversation(c.index, c.kind, 0.0, c.system, c.users)  # one of each kind, one after the other
             for c in conversations(2, 1.0, args.seed + 7, systems, args.turns, 0.5)]
    records, _ = asyncio.run(drive(url, model, convs, {}, args, one_at_a_time=True))
    bad = [r.error for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"the calibration conversations failed: {bad[:3]}")
    ttft = [r.ttft_ms for r in records if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in records if r.tpot_ms is not None]
    return {"ttft_ms": [round(x, 1) for x in ttft], "tpot_ms": [round(x, 2) for x in tpot],
            "base_ttft_ms": spread(ttft)["median"], "base_tpot_ms": spread(tpot)["median"]}


def slos(base_ttft_ms: float, base_tpot_ms: float, args: argparse.Namespace) -> dict:
    """{tier: {ttft_ms, tpot_ms}}: interactive at the first multiples, chat at the second."""
    return {tier: {"ttft_ms": round(base_ttft_ms * tx, 1), "tpot_ms": round(base_tpot_ms * px, 2)}
            for tier, tx, px in zip(("interactive", "chat"), args.ttft_x, args.tpot_x, strict=True)}


# ------------------------------------------------------------------------------------------ rounds


def run_rounds(stacks: dict, model: str, tok, slo: dict, args: argparse.Namespace) -> list[dict]:
    """Every round, every rate, every arm on the same conversations; the first arm rotates."""
    points = []
    arms = list(ARMS)
    for r in range(args.rounds):
        for i, rate in enumerate(args.rates):
            seed = args.seed + 1000 * r + i
            tag = f"[round {r + 1} rate {rate:g} {secrets.token_hex(3)}]"
            n = admission.n_for(rate, args.duration_s)
            convs = conversations(n, rate, seed, system_prompts(tok, tag, args.system_tokens), args.turns,
                                  args.interactive_share)
            k = (r + i) % len(arms)
            order = arms[k:] + arms[:k]
            for arm in order:
                time.sleep(args.quiet_s)
                records, duration = asyncio.run(drive(stacks[arm].url, model, convs, slo, args))
                p = {"round": r, "rate": rate, "arm": arm, "order": order.index(arm), "seed": seed, "tag": tag,
                     "conversations": n} | point_summary(records, duration, n * args.turns)
                p["idle_after"] = idle(stacks[arm])
                points.append(p)
                print(f"round {r + 1} rate {rate:g} {arm:4s}: attainment {_pct(p['attainment'])} (TTFT "
                      f"{_pct(p['ttft_attainment'])}, TPOT {_pct(p['tpot_attainment'])}), refused {p['refused']}, "
                      f"failed {p['failed']}, cached {p['cached_tokens']} of {p['prompt_tokens']} prompt tokens, "
                      f"goodput {p['goodput_tok_s'] or 0:.1f} tok/s, {duration:.0f} s", file=sys.stderr, flush=True)
    return points


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _spread(values: list) -> dict | None:
    xs = [v for v in values if v is not None]
    return spread(xs) if xs else None


def summarize_points(points: list[dict], rates: list[float], rounds: int) -> dict:
    """Per arm and rate the spread of each figure over rounds; on / off per round; the rate where FIFO's
    median attainment is nearest 50 % and the ratio there, against the target."""
    def at(arm: str, rate: float, r: int | None = None) -> list[dict]:
        return [p for p in points if p["arm"] == arm and p["rate"] == rate and r in (None, p["round"])]

    arms = {arm: {f"{rate:g}": {k: _spread([p[k] for p in at(arm, rate)]) for k in FIGURES} for rate in rates}
            for arm in ARMS}
    ratios = {}
    for rate in rates:
        per_round = []
        for r in range(rounds):
            on, off = at("on", rate, r)[0]["attainment"] or 0.0, at("off", rate, r)[0]["attainment"] or 0.0
            per_round.append(on / off if off else None)  # (None: off met none)
        ratios[f"{rate:g}"] = {"per_round": per_round, "spread": _spread(per_round)}
    fifo = {rate: (arms["fifo"][f"{rate:g}"]["attainment"] or {}).get("median", 0.0) for rate in rates}
    rate50 = min(rates, key=lambda rate: abs(fifo[rate] - 0.5))
    there = ratios[f"{rate50:g}"]["spread"]
    return {"arms": arms, "ratio_on_off": ratios, "fifo_50_rate": rate50, "fifo_attainment_there": fifo[rate50],
            "ratio_at_fifo_50": there, "target_ratio": GOAL,
            "target_met": None if there is None else there["median"] >= GOAL,
            "lost": sum(p["lost"] for p in points), "all_idle_after": all(p["idle_after"] for p in points)}


def _agg(s: dict | None, scale: float = 1.0, spec: str = ".0f") -> str:
    if s is None:
        return "-"
    med, lo, hi = (format(s[k] * scale, spec) for k in ("median", "min", "max"))
    return med if lo == hi else f"{med} ({lo}-{hi})"


def table(summary: dict, rates: list[float]) -> str:
    lines = ["| rate conv/s | arm | attainment % | TTFT % | TPOT % | goodput tok/s | refused | failed | "
             "cached / prompt tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        for arm in ARMS:
            a = summary["arms"][arm][f"{rate:g}"]
            lines.append(f"| {rate:g} | {arm} | {_agg(a['attainment'], 100)} | {_agg(a['ttft_attainment'], 100)} | "
                         f"{_agg(a['tpot_attainment'], 100)} | {_agg(a['goodput_tok_s'], 1, '.1f')} | "
                         f"{_agg(a['refused'])} | {_agg(a['failed'])} | {_agg(a['cached_tokens'])} / "
                         f"{_agg(a['prompt_tokens'])} |")
    lines += ["", "| rate conv/s | on / off attainment per round | median (min-max) |", "|---|---|---|"]
    for rate in rates:
        x = summary["ratio_on_off"][f"{rate:g}"]
        per = ", ".join("-" if v is None else f"{v:.2f}x" for v in x["per_round"])
        lines.append(f"| {rate:g} | {per} | {_agg(x['spread'], 1, '.2f')} |")
    rate50 = summary["fifo_50_rate"]
    lines += ["", f"FIFO nearest 50 %: {rate50:g} conv/s ({100 * summary['fifo_attainment_there']:.0f} %); on / off "
              f"there {_agg(summary['ratio_at_fifo_50'], 1, '.2f')} (target >= {GOAL}x: "
              f"{'met' if summary['target_met'] else 'not met'}); requests lost {summary['lost']}; every block free "
              f"after every point: {summary['all_idle_after']}"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=_floats, default=[0.3, 0.4], help="conversations per second "
                    "(the default: around FIFO's 50 % on SmolLM2 and the 2-core machine, at the default SLOs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration-s", type=float, default=35.0, help="seconds of conversation arrivals per point")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a named model or a directory (`demo`: the "
                    "bundled demo pair, to check that the script runs)")
    ap.add_argument("--targets", type=int, default=2, help="target replicas of each stack")
    ap.add_argument("--policy", default=None, help="`up --policy` (default: up's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each model service")
    ap.add_argument("--profile", default=None, help="`up --profile` (default: beside --out, "
                    "measured by the first stack if missing)")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation (at most 8)")
    ap.add_argument("--answer-tokens", type=int, default=48, help="max_tokens of each answer")
    ap.add_argument("--system-tokens", type=int, default=256, help="the support kind's system prompt, tokens "
                    "(the garden kind's: a quarter)")
    ap.add_argument("--think-s", type=float, default=1.0, help="seconds between an answer's end and the next turn")
    ap.add_argument("--interactive-share", type=float, default=0.5, help="share of support (interactive) "
                    "conversations")
    ap.add_argument("--ttft-x", type=_floats, default=[2.0, 4.0], help="TTFT SLO of the interactive and the chat "
                    "tier, multiples of the base TTFT")
    ap.add_argument("--tpot-x", type=_floats, default=[1.5, 3.0], help="TPOT SLO of the two tiers, multiples of "
                    "the base TPOT")
    ap.add_argument("--base-ttft-ms", type=float, default=None, help="the base TTFT (default: calibrated)")
    ap.add_argument("--base-tpot-ms", type=float, default=None, help="the base TPOT (default: calibrated)")
    ap.add_argument("--quiet-s", type=float, default=2.0, help="idle seconds before each point")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if not 1 <= args.turns <= min(len(k.questions) for k in KINDS.values()):
        ap.error("--turns must be 1 to 8")
    if len(args.ttft_x) != 2 or len(args.tpot_x) != 2:
        ap.error("--ttft-x and --tpot-x take two multiples: the interactive tier's, then the chat tier's")
    if (args.base_ttft_ms is None) != (args.base_tpot_ms is None):
        ap.error("give both --base-ttft-ms and --base-tpot-ms, or neither")
    if not args.rates or min(args.rates) <= 0 or args.rounds < 1:
        ap.error("--rates must be positive and --rounds at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from transformers import AutoTokenizer

    from specserve.shared.runtime.model_store import MODELS, resolve

    os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))  # every stack's services and clients
    tok = AutoTokenizer.from_pretrained(str(MODELS / "target") if args.model == "demo" else resolve(args.model))
    model = "target" if args.model == "demo" else args.model  # the id the gateway serves
    stacks = start_stacks(args)
    try:
        for up in stacks.values():  # through every path before anything is timed
            asyncio.run(drive(up.url, model, conversations(1, 1.0, args.seed + 9, system_prompts(
                tok, f"[warm-up {secrets.token_hex(3)}]", 32), 1, 0.0), {}, args))
        if args.base_ttft_ms is None:
            calibration = calibrate(stacks["fifo"].url, model, tok, args)
        else:
            calibration = {"base_ttft_ms": args.base_ttft_ms, "base_tpot_ms": args.base_tpot_ms, "given": True}
        slo = slos(calibration["base_ttft_ms"], calibration["base_tpot_ms"], args)
        print(f"base TTFT {calibration['base_ttft_ms']:.0f} ms, TPOT {calibration['base_tpot_ms']:.1f} ms; "
              f"SLOs {slo}", file=sys.stderr, flush=True)
        points = run_rounds(stacks, model, tok, slo, args)
    finally:
        stop_stacks(stacks)
    summary = summarize_points(points, args.rates, args.rounds)
    setting = {k: v for k, v in vars(args).items() if k != "out"} | {
        "arms": {"on": "the default, prefix caching on", "off": "the default, prefix caching off",
                 "fifo": "--admission fifo, prefix caching off"},
        "kinds": {name: {"tier": k.tier, "service_tier": k.service_tier} for name, k in KINDS.items()}}
    result = {"meta": machine_info() | {"argv": sys.argv[1:] if argv is None else argv}, "setting": setting,
              "calibration": calibration, "slo": slo, "summary": summary, "points": points}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(relative_paths(result), indent=1) + "\n")
    print(table(summary, args.rates))
    print(f"\nwrote {args.out}")
    return 0 if summary["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
