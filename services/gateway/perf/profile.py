"""`specserve profile`: the per-pass token budget B and the baseline latency, measured through the target service.

AdaServe's budget B is the knee of the target's latency-vs-tokens curve, and its tightest SLO class is
the "baseline latency": the minimal per-iteration latency of incremental decoding at batch 8, input 32,
output 128. Both are measured here the way the gateway will see them: wall-clock time of one `Forward`
call on the client (transport included) against a running target service.

The knee rule. On a few CPU cores the one-token pass is anomalously cheap (a matrix-vector path; see
docs/lab/forward_latency.md), so "largest N within 1.25x the 1-token latency" gives B = 1.
The reference here is the batch-8 decode pass instead (8 requests x 1 root token), and B is the
largest measured token count, walking upward and stopping at the first failure, whose median pass
latency stays within `knee_ratio` x that reference; never below 8 (the batch's roots).

The curve is measured in interleaved rounds (every size once per round, the reference's decode pass
included), so the reference and the points share the same conditions: the same context lengths
(which grow during the run) and any interference from other processes spread over all sizes alike
instead of landing on a few consecutive ones. The same rounds time a lone request's chains of
SINGLE_SIZES nodes (`single`): what one more drafted token costs at small passes, where a CPU's
one-token pass takes a cheaper path than the batch-8 curve's slope says (the cost model's small counts).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import random
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path

from specserve.shared.wire.messages import HealthReply, SamplingSpec
from specserve.shared.wire.service_client import PrefillItem, StepOutput, TargetClient, VerifyItem

__all__ = ["DEFAULT_TREE_SIZES", "MIN_BUDGET", "Profile", "add_flags", "default_profile_path", "knee", "main",
           "measure"]

log = logging.getLogger("specserve.profile")

MIN_BUDGET = 8  # B never goes below the batch-8 decode pass: 8 roots
BATCH, INPUT_TOKENS, OUTPUT_TOKENS = 8, 32, 128  # AdaServe's baseline-latency setting
DEFAULT_TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # nodes per request (a chain: root + k-1 drafts)
SINGLE_SIZES = (1, 2, 4, 8)  # nodes of a lone request's chains (the `single` curve)
QUICK = {"output_tokens": 16, "tree_sizes": (1, 2, 4, 8), "repeats": 3}  # --quick
# The profile's wall-clock bound: on a slow machine (or pass) it measures fewer decode passes and rounds,
# never fewer than MIN_DECODE_PASSES and one timed round, so that a first start takes minutes at most.
TIME_BUDGET_S = 40.0
MIN_DECODE_PASSES = 8
DECODE_SHARE = 0.3  # of the time bound, at most this much goes to the decode passes


@dataclass
class Profile:
    budget_tokens: int  # B, tokens per target pass (roots included)
    baseline_iteration_ms: float  # min per-iteration latency, incremental decoding, batch 8, input 32, output 128
    knee_ratio: float
    curve: list[tuple[int, float]]  # (tokens in the pass, median ms), as measured
    model: str  # the target's model directory (as the service reports it)
    device: str
    dtype: str
    created: str  # ISO 8601 time of the measurement
    batch: int
    input_tokens: int
    output_tokens: int
    reference_ms: float = 0.0  # median latency of the batch-decode pass in the curve's rounds: the knee's reference
    fingerprint: str = ""  # the measured target's (HealthReply.fingerprint): what set these latencies
    single: list[tuple[int, float]] = field(default_factory=list)  # (nodes of a lone request's chain, median ms)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data["curve"] = [list(point) for point in self.curve]
        data["single"] = [list(point) for point in self.single]
        text = json.dumps(data, indent=2)
        # one line per curve point (JSON strings hold no raw line feeds, so this touches only the pairs)
        text = re.sub(r"\[\n\s+(-?\d+),\n\s+([-+.\deE]+)\n\s+\]", r"[\1, \2]", text)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)  # atomic: a gateway reading it never sees half a file
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        profile = cls(**{k: v for k, v in data.items() if k in known})  # unknown keys: a newer writer
        profile.curve = [(int(n), float(ms)) for n, ms in profile.curve]
        profile.single = [(int(n), float(ms)) for n, ms in profile.single]
        return profile


def default_profile_path(model_dir: str | Path, device: str, fingerprint: str = "") -> Path:
    """Where `specserve profile` saves, and the gateway looks, by default:
    ~/.cache/specserve/profile-<model dir name>-<device>-<hash of the target's fingerprint>.json (device
    "cuda:0" is written "cuda-0"), so that a target whose passes differ (other weights or files, pass,
    dtype, threads, simulation preset or time scale) is measured anew instead of judged by another's."""
    name = Path(model_dir).expanduser().resolve().name or "model"
    safe_device = re.sub(r"[^A-Za-z0-9._-]", "-", str(device))
    key = f"-{hashlib.sha1(fingerprint.encode()).hexdigest()[:10]}" if fingerprint else ""
    return Path.home() / ".cache" / "specserve" / f"profile-{name}-{safe_device}{key}.json"


def knee(curve: list[tuple[int, float]], reference_ms: float, ratio: float) -> int:
    """B: the largest token count N whose latency is <= ratio x reference_ms, walking N upward and
    stopping at the first N that fails (a later point that dips back under does not count); never
    below MIN_BUDGET.

    >>> knee([(8, 10.0), (16, 11.0), (32, 12.4), (64, 19.0), (128, 12.0)], reference_ms=10.0, ratio=1.25)
    32
    """
    if not reference_ms > 0:
        raise ValueError(f"the reference latency must be positive, got {reference_ms}")
    if not ratio >= 1.0:
        raise ValueError(f"the knee ratio must be >= 1.0, got {ratio}")
    limit = ratio * reference_ms
    best = MIN_BUDGET
    for tokens, latency in sorted(curve, key=lambda p: p[0]):
        if latency > limit:
            break
        best = max(best, int(tokens))
    return best


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def kv_blocks_needed(batch: int, input_tokens: int, output_tokens: int, tree_sizes: tuple[int, ...], repeats: int,
                     block_size: int = 16, worst_case: bool = True) -> int:
    """KV blocks the measurement can hold at once. Each chain call commits 1 + its accepted drafts
    (worst case: all of them); the chain being verified needs its nodes' slots on top."""
    calls = [(repeats + 1, k) for k in {1, *tree_sizes}]  # one untimed warm-up round
    grown = sum(n * k for n, k in calls) if worst_case else sum(n for n, _ in calls)
    per_request = input_tokens + 1 + output_tokens + grown + max(tree_sizes, default=1)
    lone = [(repeats + 1, k) for k in SINGLE_SIZES]  # the lone request: no decode passes
    grown_lone = sum(n * k for n, k in lone) if worst_case else sum(n for n, _ in lone)
    return batch * _blocks(per_request, block_size) + _blocks(input_tokens + 1 + grown_lone + max(SINGLE_SIZES),
                                                              block_size)


class _Batch:
    """The profile's requests on the target: their committed counts, roots and step numbers."""

    def __init__(self, target: TargetClient, rids: list[str], vocab_size: int, rng: random.Random):
        self.target, self.rids, self.vocab_size, self.rng = target, rids, vocab_size, rng
        self.step = 0
        self.committed: dict[str, int] = {}
        self.root: dict[str, int] = {}

    @staticmethod
    def _check(outputs: list[StepOutput]) -> None:
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"the target refused {out.rid} (step {out.step}): "
                                   f"{out.error.code}: {out.error.message}")

    async def prefill(self, input_tokens: int) -> None:
        self.step += 1
        items = [PrefillItem(rid, self.step, 0, [self.rng.randrange(1, self.vocab_size) for _ in range(input_tokens)],
                             True, SamplingSpec()) for rid in self.rids]
        outputs, _ = await self.target.forward(prefill=items)
        self._check(outputs)
        for out in outputs:
            self.committed[out.rid] = input_tokens + 1
            self.root[out.rid] = out.tokens[-1]

    async def verify_chains(self, k: int) -> float:
        """One Forward in which every request verifies a k-node chain; returns its wall-clock ms."""
        self.step += 1
        items = [VerifyItem(rid, self.step, self.committed[rid],
                            [self.root[rid]] + [self.rng.randrange(1, self.vocab_size) for _ in range(k - 1)],
                            list(range(-1, k - 1))) for rid in self.rids]
        t0 = time.perf_counter()
        outputs, _ = await self.target.forward(verify=items)
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        self._check(outputs)
        for out in outputs:
            self.committed[out.rid] += len(out.tokens)
            self.root[out.rid] = out.tokens[-1]
        return elapsed_ms


async def measure(target: TargetClient, *, batch: int = BATCH, input_tokens: int = INPUT_TOKENS,
                  output_tokens: int = OUTPUT_TOKENS,
                  tree_sizes: tuple[int, ...] = DEFAULT_TREE_SIZES, repeats: int = 7, knee_ratio: float = 1.25,
                  vocab_size: int, progress: bool = True, seed: int = 0,
                  time_budget_s: float = TIME_BUDGET_S) -> Profile:
    """Measure the baseline latency and the latency-vs-tokens curve on a running target; fit B.

    1. `batch` requests with random `input_tokens`-token prompts (seeded) are prefilled, greedy;
    2. `output_tokens` root-only decode passes (batch tokens each): the baseline is their minimum;
    3. one untimed warm-up round, then `repeats` rounds; a round runs one pass per tree size k (and
       k = 1 if not listed) in which every request verifies a chain of k nodes (root + k-1 random
       tokens). Curve point: (batch*k, median ms over the rounds). The knee's reference is the
       median of the k = 1 passes (the batch-decode pass, measured beside the other points). Each
       round also runs one pass per k in SINGLE_SIZES in which a lone request (prefilled likewise)
       verifies a chain of k nodes: the `single` points (k, median ms).
    Bounded by `time_budget_s` of wall clock: the decode passes stop early (never before
    MIN_DECODE_PASSES) once they have taken DECODE_SHARE of it, and the rounds stop early (never before
    the first timed round) when the next round, as long as the last, would end past it; the profile
    records the decode passes it measured (`output_tokens`) and says so on stderr.
    Every request is released at the end, also when a step fails.
    """
    from tqdm import tqdm

    health = await _check(target, batch, input_tokens, output_tokens, tree_sizes, repeats)

    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:8]
    run = _Batch(target, [f"profile-{tag}-{i}" for i in range(batch)], vocab_size, rng)
    lone = _Batch(target, [f"profile-{tag}-lone"], vocab_size, rng)
    sizes = sorted({1, *tree_sizes})
    shapes = [(run, k) for k in sizes] + [(lone, k) for k in SINGLE_SIZES]
    bar = tqdm(total=2 + output_tokens + len(shapes) * (repeats + 1), desc="profile", unit="pass",
               file=sys.stderr, disable=not progress, dynamic_ncols=True)
    finished = False
    start = time.monotonic()
    try:
        for each in (run, lone):
            await each.prefill(input_tokens)
            bar.update()
        decode = await _decode_passes(run, output_tokens, start, time_budget_s, bar.update)
        samples, rounds = await _rounds(shapes, repeats, start, time_budget_s, bar.update)
        finished = True
    finally:
        bar.close()
        try:
            await target.release(run.rids + lone.rids)
        except Exception:
            if finished:
                raise
            log.warning("could not release the profile's requests after a failure", exc_info=True)

    if len(decode) < output_tokens or rounds < repeats:
        print(f"profile: {len(decode)} of {output_tokens} decode passes and {rounds} of {repeats} rounds "
              f"within its {time_budget_s:.0f} s bound ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    curve = [(batch * k, round(statistics.median(samples[0, k]), 3)) for k in sorted(set(tree_sizes))]
    single = [(k, round(statistics.median(samples[1, k]), 3)) for k in SINGLE_SIZES]
    reference = statistics.median(samples[0, 1])
    return Profile(budget_tokens=knee(curve, reference, knee_ratio), baseline_iteration_ms=round(min(decode), 3),
                   knee_ratio=knee_ratio, curve=curve, model=health.model, device=health.device, dtype=health.dtype,
                   fingerprint=health.fingerprint, created=datetime.now(UTC).isoformat(timespec="seconds"),
                   batch=batch, input_tokens=input_tokens, output_tokens=len(decode), reference_ms=round(reference, 3),
                   single=single)


async def _check(target: TargetClient, batch: int, input_tokens: int, output_tokens: int, tree_sizes: tuple[int, ...],
                 repeats: int) -> HealthReply:
    """The target's health, once the settings are valid and its free KV blocks hold the measurement."""
    if batch < 1 or input_tokens < 1 or output_tokens < 1 or repeats < 1:
        raise ValueError("batch, input_tokens, output_tokens and repeats must be positive")
    if not tree_sizes or min(tree_sizes) < 1:
        raise ValueError(f"tree sizes must be positive, got {tree_sizes}")
    health = await target.health()
    stats = await target.stats()
    need = kv_blocks_needed(batch, input_tokens, output_tokens, tuple(tree_sizes), repeats, stats.block_size,
                            worst_case=False)
    if need > stats.free_blocks:
        raise ValueError(f"the profile needs about {need} free KV blocks on the target; it has {stats.free_blocks} "
                         f"of {stats.total_blocks} (start it with more --kv-blocks)")
    return health


async def _decode_passes(run: _Batch, count: int, start: float, time_budget_s: float,
                         tick: Callable[[], object]) -> list[float]:
    """Up to `count` root-only decode passes (ms each): never fewer than MIN_DECODE_PASSES, and none
    started after DECODE_SHARE of the time bound."""
    decode: list[float] = []
    while len(decode) < count:
        if len(decode) >= MIN_DECODE_PASSES and time.monotonic() - start > DECODE_SHARE * time_budget_s:
            break
        decode.append(await run.verify_chains(1))
        tick()
    return decode


async def _rounds(shapes: list[tuple[_Batch, int]], repeats: int, start: float, time_budget_s: float,
                  tick: Callable[[], object]) -> tuple[dict[tuple[int, int], list[float]], int]:
    """An untimed warm-up round, then up to `repeats` timed rounds of one pass per shape (a batch and its
    chains' nodes k), the last one begun only if, as long as the round before it, it ends within the time
    bound. Returns the ms by (the batch's index among the shapes' batches, k) and the timed rounds run."""
    runs = list(dict.fromkeys(run for run, _ in shapes))
    samples: dict[tuple[int, int], list[float]] = {(runs.index(run), k): [] for run, k in shapes}
    rounds = 0
    for round_ in range(repeats + 1):  # round 0 is the warm-up (each shape's first pass)
        began = time.monotonic()
        for run, k in shapes:
            elapsed = await run.verify_chains(k)
            if round_:
                samples[runs.index(run), k].append(elapsed)
            tick()
        rounds = round_
        now = time.monotonic()
        if round_ and round_ < repeats and now + (now - began) - start > time_budget_s:
            break
    return samples, rounds


def add_flags(parser: argparse.ArgumentParser) -> None:
    from specserve.shared.host.service_base import default_threads

    parser.add_argument("--target", metavar="ADDR",
                        help="address of a running target service (host:port or unix:/path); "
                             "without it, one is started for the measurement and stopped after")
    parser.add_argument("--model", help="model directory of the started target (default: the target service's "
                                        "default, the bundled demo target)")
    parser.add_argument("--device", help="device of the started target, cpu or cuda[:N] (default: the service's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the started target (default: the service's)")
    parser.add_argument("--threads", type=int, default=default_threads(),
                        help="torch intra-op threads of the started target")
    parser.add_argument("--out", metavar="PATH", help="where to write the profile JSON "
                        "(default: ~/.cache/specserve/profile-<model dir name>-<device>.json, where the gateway looks)")
    parser.add_argument("--knee-ratio", type=float, default=1.25,
                        help="B is the largest token count whose pass stays within this x the batch-8 decode pass")
    parser.add_argument("--time-budget-s", type=float, default=TIME_BUDGET_S,
                        help="wall-clock bound of the measurement: on a slow target it measures fewer passes")
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer passes for a smoke run ({QUICK['output_tokens']} decode passes, "
                             f"sizes {QUICK['tree_sizes']}, {QUICK['repeats']} repeats)")


def _settings(args: argparse.Namespace) -> dict:
    settings = {"output_tokens": OUTPUT_TOKENS, "tree_sizes": DEFAULT_TREE_SIZES, "repeats": 7,
                "time_budget_s": getattr(args, "time_budget_s", TIME_BUDGET_S)}
    if args.quick:
        settings.update(QUICK)
    return settings


async def _profile(address: str, args: argparse.Namespace, settings: dict) -> Profile:
    from specserve.shared.runtime.model_config import ModelConfig

    target = await TargetClient.connect(address)
    try:
        health = await target.health()
        # The service's model path may be relative to its own directory: --model is the fallback.
        candidates = [health.model] + ([args.model] if args.model else [])
        config = next((ModelConfig.from_dir(d) for d in candidates if (Path(d) / "config.json").is_file()), None)
        if config is None:
            raise RuntimeError(f"cannot read the target's config.json (model {health.model!r}); pass --model DIR")
        vocab_size = config.vocab_size
        return await measure(target, knee_ratio=args.knee_ratio, vocab_size=vocab_size, **settings)
    finally:
        await target.close()


def format_table(profile: Profile) -> str:
    limit = profile.knee_ratio * profile.reference_ms if profile.reference_ms > 0 else math.inf
    lines = [f"{'tokens':>7} {'per req':>8} {'median ms':>10} {'x ref':>6}",
             f"{'-' * 7} {'-' * 8} {'-' * 10} {'-' * 6}"]
    for tokens, ms in profile.curve:
        ratio = ms / profile.reference_ms if profile.reference_ms > 0 else math.nan
        over = ms > limit
        if tokens == profile.budget_tokens:
            mark = f"  <- B (over, but B is never below {MIN_BUDGET})" if over else "  <- B"
        else:
            mark = "  over" if over else ""
        lines.append(f"{tokens:>7} {tokens // profile.batch:>8} {ms:>10.2f} {ratio:>6.2f}{mark}")
    if profile.single:
        lines.append("a lone request's chain: " + ", ".join(f"{k} nodes {ms:.2f} ms" for k, ms in profile.single))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from specserve.shared.host.launch import ServiceProcess

    settings = _settings(args)
    proc = None
    try:
        if args.target:
            address = args.target
        else:
            service_args = ["--kv-blocks", str(kv_blocks_needed(BATCH, INPUT_TOKENS, settings["output_tokens"],
                                                                settings["tree_sizes"], settings["repeats"]))]
            for flag, value in (("--model", args.model), ("--device", args.device), ("--dtype", args.dtype)):
                if value:
                    service_args += [flag, str(value)]
            proc = ServiceProcess("target", *service_args, threads=args.threads, unix=True)  # as `up` runs it
            address = proc.address
        profile = asyncio.run(_profile(address, args, settings))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.stop()
    out = profile.save(Path(args.out) if args.out else default_profile_path(profile.model, profile.device,
                                                                            profile.fingerprint))
    print(f"target: {profile.model} ({profile.device}, {profile.dtype}); batch {profile.batch}, "
          f"input {profile.input_tokens}, {profile.output_tokens} decode passes")
    print(format_table(profile))
    print(f"reference (median batch-{profile.batch} decode pass, measured with the curve): "
          f"{profile.reference_ms:.2f} ms; limit {profile.knee_ratio} x reference = "
          f"{profile.knee_ratio * profile.reference_ms:.2f} ms")
    print(f"budget B = {profile.budget_tokens} tokens per pass; baseline latency = "
          f"{profile.baseline_iteration_ms:.2f} ms per iteration")
    print(f"saved {out}")
    return 0
