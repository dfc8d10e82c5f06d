"""Latency of ONE target forward pass (`ModelRunner.forward`) vs tokens in it and batch composition.

    .venv/bin/python bench/forward_latency.py [--quick] [--dtype float32|bfloat16] [--device cpu|cuda]
        [--model DIR] [--repeats N] [--warmup N] [--context N] [--out FILE.md]

(a) latency vs the number of tokens in the pass (1..512), as decode tokens (N requests x 1 token)
    and as token trees (8 requests x N/8 nodes);
(b) latency vs batch composition at fixed totals (64 and 256 tokens): all decode, trees of
    different widths, and a prefill chunk mixed with decodes.

Method (also written into the report):
- Every request first gets `--context` committed tokens (default 128), untimed: 16 distinct prompts
  are prefilled by real forward passes and the other requests get copies of their KV rows (a
  forward's cost does not depend on the cached values; a real 512 x 128 prefill would dominate).
- A decode token is a root-only Tree (the root is the request's last committed token, whose KV is
  not cached yet: exactly the work of a 1-token decode chunk), discarded after the call with
  `runner.discard_tree`, so the context stays at `--context` for every call. Trees are discarded
  the same way. A prefill chunk is a Chunk appended after the context (a later chunk of a chunked
  prefill) and is cut back afterwards with `runner.blocks.truncate`.
- Only `runner.forward(entries)` is timed (input building included, as it is part of a pass);
  entries are built before and the state is restored after, untimed. With --device cuda, CUDA is
  synchronized around the call. Python GC is collected before and disabled during each scenario's loop.
- Per scenario: `--warmup` untimed calls, then `--repeats` timed calls; median, p10 and p90 in ms.
- Trees are random recursive trees (node i's parent uniform over nodes 0..i-1, seed 0). The
  runtime attends with a dense padded mask, so latency depends on node counts, not on shape.

The knee is `specserve profile`'s rule (`gateway.perf.profile.knee`, the one that fits AdaServe's B):
the largest token count, walking up from the smallest, whose median is within 1.25x the reference
(here the 1-token median), stopping at the first that is not; never below 8.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.gateway.perf.profile import knee
from specserve.shared.runtime.batch import Chunk, Entry, Tree
from specserve.shared.runtime.loader import parse_device
from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.runtime.random_model import BENCH_CONFIG, write_random_model
from specserve.shared.runtime.runner import ModelRunner

TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)
TREE_REQUESTS = 8
COMPOSITION_TOTALS = (64, 256)
TREE_WIDTHS = (16, 8, 4)  # requests sharing a fixed total as trees
KNEE_TOLERANCE = 1.25
BLOCK_SIZE = 16
PREFILL_TOKENS_PER_PASS = 2048
PREFILL_DISTINCT = 16  # prompts prefilled for real; the other requests copy their KV


@dataclass(frozen=True, slots=True)
class Part:
    kind: str  # "decode" (root-only tree), "tree", or "prefill" (a chunk after the context)
    requests: int
    tokens: int  # per request


Scenario = tuple[Part, ...]


def decode(n: int) -> Scenario:
    return (Part("decode", n, 1),)


def trees(requests: int, nodes: int) -> Scenario:
    return (Part("tree", requests, nodes),)


def num_requests(s: Scenario) -> int:
    return sum(p.requests for p in s)


def label(s: Scenario) -> str:
    names = {
        "decode": lambda p: f"{p.requests} decode x 1",
        "tree": lambda p: f"{p.requests} trees x {p.tokens} nodes",
        "prefill": lambda p: f"{p.requests} prefill chunk x {p.tokens}",
    }
    return " + ".join(names[p.kind](p) for p in s)


def compositions(total: int) -> list[Scenario]:
    out = [decode(total)]
    out += [trees(r, total // r) for r in TREE_WIDTHS if total % r == 0 and total // r >= 2]
    out.append((Part("prefill", 1, total // 2), Part("decode", total // 2, 1)))
    out.append((Part("prefill", 1, total),))
    return out


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    tokens = [rng.randrange(vocab) for _ in range(n)]
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return tokens, parents


def build_entries(s: Scenario, rng: random.Random, vocab: int) -> list[Entry]:
    entries: list[Entry] = []
    next_request = 0
    for part in s:
        for _ in range(part.requests):
            rid = f"r{next_request}"
            next_request += 1
            if part.kind == "decode":
                entries.append(Tree(rid, [rng.randrange(vocab)], [-1]))
            elif part.kind == "tree":
                tokens, parents = random_tree(rng, part.tokens, vocab)
                entries.append(Tree(rid, tokens, parents))  # logits at every node, as verification needs
            else:
                tokens = [rng.randrange(vocab) for _ in range(part.tokens)]
                entries.append(Chunk(rid, tokens, logits_at=[part.tokens - 1]))
    return entries


def restore(runner: ModelRunner, entries: list[Entry], context: int) -> None:
    for entry in entries:
        if isinstance(entry, Tree):
            runner.discard_tree(entry.request_id)
        else:
            runner.blocks.truncate(entry.request_id, context)
        if runner.num_tokens(entry.request_id) != context:
            have = runner.num_tokens(entry.request_id)
            raise RuntimeError(f"{entry.request_id} has {have} tokens after restoring, not {context}")


@dataclass(slots=True)
class Stats:
    median: float
    p10: float
    p90: float
    samples: list[float]

    @classmethod
    def of(cls, samples: list[float], spread: str = "p10-p90") -> Stats:
        """Median plus a spread: p10-p90 of the samples, or their min-max (spread="range")."""
        if len(samples) == 1:
            return cls(samples[0], samples[0], samples[0], samples)
        if spread == "range":
            return cls(statistics.median(samples), min(samples), max(samples), samples)
        q = statistics.quantiles(samples, n=10, method="inclusive")
        return cls(statistics.median(samples), q[0], q[-1], samples)

    def cell(self) -> str:
        return f"{self.median:.2f} ({self.p10:.2f}–{self.p90:.2f})"


def measure(
    runner: ModelRunner,
    entries: list[Entry],
    context: int,
    warmup: int,
    repeats: int,
    tick: Callable[[], object],
) -> Stats:
    """Time `warmup + repeats` calls of runner.forward(entries), restoring the state after each."""
    cuda = runner.device.type == "cuda"
    samples: list[float] = []
    gc.collect()
    gc.disable()
    try:
        for i in range(warmup + repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = runner.forward(entries)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            del out
            restore(runner, entries, context)
            if i >= warmup:
                samples.append(elapsed * 1e3)
            tick()
    finally:
        gc.enable()
    return Stats.of(samples)


def prefill(runner: ModelRunner, num: int, context: int, vocab: int, rng: random.Random) -> tuple[int, float]:
    """Give requests r0..r{num-1} `context` committed tokens; return (distinct prompts, seconds).

    PREFILL_DISTINCT prompts go through real forward passes; the other requests get copies of
    their KV rows (as a prefix cache would share them): a forward's cost does not depend on the
    values in the cache, and prefilling 512 x 128 tokens for real would dominate a quick run.
    """
    distinct = min(num, PREFILL_DISTINCT)
    per_pass = max(1, PREFILL_TOKENS_PER_PASS // context)
    start = time.perf_counter()
    with tqdm(total=num, desc=f"prefill {num} x {context} tokens", unit="req", file=sys.stderr) as bar:
        for first in range(0, distinct, per_pass):
            ids = range(first, min(distinct, first + per_pass))
            runner.forward([Chunk(f"r{i}", [rng.randrange(vocab) for _ in range(context)]) for i in ids])
            bar.update(len(ids))
        for first in range(distinct, num, 64):
            ids = range(first, min(num, first + 64))
            runner.blocks.append_slots({f"r{i}": context for i in ids})
            src = [s for i in ids for s in runner.blocks.physical_slots(f"r{i % distinct}", 0, context)]
            dst = [s for i in ids for s in runner.blocks.physical_slots(f"r{i}", 0, context)]
            dev = runner.device
            runner.kv.move_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
            bar.update(len(ids))
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return distinct, time.perf_counter() - start


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_busy_fraction(seconds: float = 1.0) -> float:
    """Share of all CPU time spent busy (any process) over `seconds`, from /proc/stat (0 if absent)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return sum(values), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except OSError:
        return 0.0
    total = total1 - total0
    return 0.0 if total <= 0 else 1.0 - (idle1 - idle0) / total


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def ratio(x: Stats | None, base: Stats) -> str:
    return "—" if x is None else f"{x.median / base.median:.2f}"


def report(args, info: dict[str, str], results: dict[Scenario, Stats]) -> str:
    lines = ["# Forward latency of the specserve target runtime", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [
        "",
        "Method: one timed call = `runner.forward(entries)` (input building included), after "
        f"{args.warmup} warm-up calls; {args.repeats} timed calls per row; "
        + ("median (p10–p90) in ms. " if args.runs == 1 else
           f"the whole sweep ran {args.runs} times: median of the {args.runs} per-run medians (their min–max), in ms. ")
        + f"Every request has {args.context} committed context tokens, set up beforehand (untimed) by a real "
        f"prefill of {PREFILL_DISTINCT} prompts whose KV rows the other requests copy (cost does not depend "
        "on KV values). A decode token is a root-only tree, discarded after each call (`discard_tree`), so "
        "the context does not grow; trees (random shape, logits at every node) are discarded the same way; "
        "a prefill chunk (logits at its last token) is appended after the context and truncated back. Only "
        "the forward is timed" + ("; CUDA is synchronized around it. " if args.device == "cuda" else ". ")
        + "x1-tok = median / the 1-token median.",
        "",
        "## (a) Latency vs tokens in the pass",
        "",
        f"| tokens | decode only: N requests x 1 token, ms | x1-tok "
        f"| trees: {TREE_REQUESTS} requests x N/{TREE_REQUESTS} nodes | x1-tok |",
        "|---:|---:|---:|---:|---:|",
    ]
    base = results[decode(1)]
    decode_points, tree_points = {}, {1: base.median}
    for n in TOKEN_COUNTS:
        d = results[decode(n)]
        decode_points[n] = d.median
        t = results.get(trees(TREE_REQUESTS, n // TREE_REQUESTS)) if n % TREE_REQUESTS == 0 else None
        if t is not None:
            tree_points[n] = t.median
        lines.append(f"| {n} | {d.cell()} | {ratio(d, base)} | {t.cell() if t else '—'} | {ratio(t, base)} |")
    lines += [
        "",
        f"Knee (`specserve profile`'s rule: the largest token count, walking up, with median <= {KNEE_TOLERANCE}x "
        f"the 1-token median, {base.median:.2f} ms; never below 8): decode only = "
        f"**{knee(list(decode_points.items()), base.median, KNEE_TOLERANCE)}** tokens; trees ({TREE_REQUESTS} "
        f"requests) = **{knee(list(tree_points.items()), base.median, KNEE_TOLERANCE)}** tokens.",
        "",
        "## (b) Latency vs batch composition at a fixed total",
        "",
        "| total tokens | composition | requests | median "
        + ("(p10–p90)" if args.runs == 1 else "(min–max of run medians)") + " ms | x all-decode |",
        "|---:|---|---:|---:|---:|",
    ]
    for total in COMPOSITION_TOTALS:
        all_decode = results[decode(total)]
        for s in compositions(total):
            r = results[s]
            row = [str(total), label(s), str(num_requests(s)), r.cell(), ratio(r, all_decode)]
            lines.append(f"| {' | '.join(row)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats and 1 warm-up per row (a smoke run)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", type=Path, help="HF model directory (default: random BENCH_CONFIG)")
    parser.add_argument("--repeats", type=int, help="timed calls per row (default 15, --quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed calls per row first (default 3, --quick 1)")
    parser.add_argument("--context", type=int, default=128, help="committed tokens per request (default 128)")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat the whole sweep N times; report the median of the per-run medians")
    parser.add_argument("--out", type=Path, help="also write the Markdown report to this file")
    args = parser.parse_args(argv)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.quick else 15)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.repeats < 1 or args.warmup < 0 or args.context < 1 or args.runs < 1:
        parser.error("--repeats and --runs must be >= 1, --warmup >= 0 and --context >= 1")
    try:
        parse_device(args.device)
    except ValueError as exc:
        parser.error(str(exc))

    began = time.perf_counter()
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    load_before = load_average()
    busy_before = cpu_busy_fraction()
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="specserve-bench-")
        model_dir = write_random_model(tmp.name, BENCH_CONFIG)
        c = BENCH_CONFIG
        model_desc = (
            f"random weights, BENCH_CONFIG (Llama, {c['num_hidden_layers']} layers, "
            f"hidden {c['hidden_size']}, vocab {c['vocab_size']})"
        )
    else:
        model_dir = args.model
        model_desc = str(model_dir)
    config = ModelConfig.from_dir(model_dir)
    params = config.num_parameters()
    print(f"model: {model_desc}: {params:,} parameters", file=sys.stderr)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads (default)", file=sys.stderr)

    scenarios: list[Scenario] = [decode(n) for n in TOKEN_COUNTS]
    scenarios += [trees(TREE_REQUESTS, n // TREE_REQUESTS) for n in TOKEN_COUNTS if n % TREE_REQUESTS == 0]
    for total in COMPOSITION_TOTALS:
        scenarios += compositions(total)
    scenarios = list(dict.fromkeys(scenarios))  # measure shared rows once
    pool = max(num_requests(s) for s in scenarios)

    def blocks(slots: int) -> int:
        return -(-slots // BLOCK_SIZE)

    # KV blocks: the context of every pool request, plus what the hungriest pass adds on top.
    base = blocks(args.context)
    extra = max(sum(p.requests * (blocks(args.context + p.tokens) - base) for p in s) for s in scenarios)
    num_blocks = pool * base + extra

    rng = random.Random(0)
    with torch.inference_mode():
        runner = ModelRunner.from_dir(model_dir, num_blocks, BLOCK_SIZE, args.dtype, args.device)
        distinct, prefill_s = prefill(runner, pool, args.context, config.vocab_size, rng)
        per_run: dict[Scenario, list[Stats]] = {s: [] for s in scenarios}
        calls = args.runs * len(scenarios) * (args.warmup + args.repeats)
        with tqdm(total=calls, desc="forward passes", unit="call", file=sys.stderr) as bar:
            for run in range(args.runs):
                for s in scenarios:
                    bar.set_postfix_str(f"run {run + 1}/{args.runs}: {label(s)}")
                    entries = build_entries(s, rng, config.vocab_size)
                    tick = functools.partial(bar.update, 1)
                    per_run[s].append(measure(runner, entries, args.context, args.warmup, args.repeats, tick))
        # One run: its median (p10-p90). Several: the median of the run medians (their min-max).
        results = {
            s: runs[0] if len(runs) == 1 else Stats.of([r.median for r in runs], spread="range")
            for s, runs in per_run.items()
        }
    if tmp is not None:
        tmp.cleanup()

    device = cpu_model()
    if args.device == "cuda":
        device = f"{torch.cuda.get_device_name()} (host CPU: {device})"
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {
        "date": started_at,
        "machine": f"{device}; {os.cpu_count()} logical cores ({affinity} usable); {platform.platform()}",
        "torch": f"{torch.__version__}; torch.get_num_threads() = {torch.get_num_threads()} (the default)",
        "device / dtype": f"{args.device} / {args.dtype}",
        "model": f"{model_desc}; {params:,} parameters",
        "runner": f"KV block size {BLOCK_SIZE}, {num_blocks} blocks; {pool} requests x {args.context} "
        f"context tokens ({distinct} distinct prompts prefilled, the rest copy their KV), "
        f"set up in {prefill_s:.1f} s",
        "repeats": f"{args.repeats} timed + {args.warmup} warm-up calls per row"
        + (" (--quick)" if args.quick else "")
        + (f"; whole sweep run {args.runs} times" if args.runs > 1 else ""),
        "CPU busy (all processes) in the second before the run": f"{busy_before:.0%}",
        "load average (1/5/15 min) before / after": f"{load_before} / {load_average()}",
        "wall time of the whole run": f"{time.perf_counter() - began:.0f} s",
    }
    if busy_before > 0.25:
        info["WARNING"] = (
            f"the CPU was {busy_before:.0%} busy before the run started: other processes were running, "
            "so these numbers are noisy"
        )
    text = report(args, info, results)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
