"""PB*: the prefill budget a time window can supply after the decode SLOs are paid (digest §§6-7).

Batches last t0 = the tightest TPOT among the decoding requests and each holds `cap` = time2bs(t0)
tokens. Decode tokens are handed out earliest-due-first; what a batch has left is its prefill
budget. `None` means infeasible: some batch cannot hold the decode tokens due in it.

- `pb_schedule`: Algorithm 2 as corrected in the digest (errata 1-3), one request at a time on a heap;
- `pb_closed_form`: the same number in O(tiers) (the planner's `BatchShape` with every TPOT at t0);
- `TierLoad` / `BatchShape`: the speculative variant of §7 with our measured per-tier cost (tree
  nodes verified per request per pass) and yield (tokens emitted per pass) in place of Acc(sl):
  a batch may last T = min_l TPOT_l · yield_l, and holds time2bs(T) − Σ_l n_l · cost_l prefill tokens.

A TPOT is a mean over a request's tokens, and a pass has a large fixed cost, so batches of exactly T
are the dearest way to feed prompts beside decoders: `BatchShape` also plans *cycles* of k passes of
the decoders alone (each of s < T ms, banking T − s) and one long pass of (k+1)·T − k·s ms that spends
what they banked on prompt tokens. Every decoder's token still comes by its due time (the bank is
built before it is spent), and one long pass holds far more prompt tokens than k+1 batches of T.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

EPS = 1e-9  # ms: due times that agree to this are equal
CYCLE_GAIN = 1.2  # cycles are planned only where they feed prompts this much faster than batches of T
CYCLE_NEAR = 0.9  # of the cycles, the shortest that feeds this share of the best one's rate


def pb_schedule(window_ms: float, tpots_ms: Sequence[float], cap: int, t0_ms: float | None = None) -> int | None:
    """Algorithm 2 (corrected): simulate floor(window / t0) batches of `cap` tokens each."""
    t0 = min(tpots_ms) if tpots_ms else t0_ms
    if t0 is None or t0 <= 0:
        raise ValueError("PB* needs a batch length: decoding requests or an explicit t0")
    heap = [(0.0, i) for i in range(len(tpots_ms))]  # (next token due, request)
    total = 0
    for i in range(int(math.floor(window_ms / t0 + EPS))):
        budget = cap
        while heap and heap[0][0] <= i * t0 + EPS:
            if budget <= 0:
                return None
            due, r = heapq.heappop(heap)
            budget -= 1
            heapq.heappush(heap, (due + tpots_ms[r], r))
        total += budget
    return total


def pb_closed_form(window_ms: float, decoders: Sequence[tuple[float, int]], cap: int,
                   t0_ms: float | None = None) -> int | None:
    """B·cap − Σ_r (⌊(B−1)·t0 / TPOT_r⌋ + 1), feasible iff every request fits batch 0 (digest §6).

    `decoders` is (TPOT ms, how many) pairs, so the cost is per tier, not per request."""
    t0 = min((tpot for tpot, n in decoders if n > 0), default=t0_ms)
    if t0 is None or t0 <= 0:
        raise ValueError("PB* needs a batch length: decoding requests or an explicit t0")
    batches = int(math.floor(window_ms / t0 + EPS))
    if batches == 0:
        return 0
    if sum(n for _, n in decoders) > cap:
        return None
    return batches * cap - sum(n * (int(math.floor((batches - 1) * t0 / tpot + EPS)) + 1) for tpot, n in decoders if n)


@dataclass(frozen=True, slots=True)
class TierLoad:
    """What one decoding request of a tier costs and yields per target pass (measured)."""

    tpot_ms: float  # the tier's TPOT SLO, ms per token
    cost: float = 1.0  # tree nodes verified per request per pass, root included (1: plain decoding)
    gain: float = 1.0  # tokens emitted per request per pass (1: plain decoding)
    paced: bool = True  # False: best effort, which costs its tokens but never sets the batch length


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The batches a set of decoders allows: their length and the prefill tokens each can carry, and the
    cycle that feeds prompts more (`cycle` passes of the decoders alone, then one long pass)."""

    length_ms: float  # T: one batch, ms
    prefill_per_batch: int  # tokens left for prompts in each batch (negative: the decoders do not fit)
    cycle: int = 0  # k: passes of the decoders alone before each long pass (0: batches of T only)
    long_ms: float = 0.0  # the long pass, ms: (k+1)·T − k·s
    long_prefill: int = 0  # the prompt tokens it holds
    decode: int = 0  # the decoders' tokens in every pass

    @property
    def feasible(self) -> bool:
        return self.prefill_per_batch >= 0

    @property
    def rate(self) -> float:
        """Prompt tokens it feeds per T."""
        return self.long_prefill / (self.cycle + 1) if self.cycle else float(self.prefill_per_batch)

    def budget(self, window_ms: float) -> int:
        """The prefill tokens of the whole cycles that fit in the window, then of its whole batches of T."""
        batches = int(math.floor(window_ms / self.length_ms + EPS))
        if self.cycle == 0:
            return batches * self.prefill_per_batch
        cycles, rest = divmod(batches, self.cycle + 1)
        return cycles * self.long_prefill + rest * self.prefill_per_batch


def batch_shape(counts: Sequence[int], tiers: Sequence[TierLoad], time2bs: Callable[[float], int],
                idle_ms: float, longest_ms: float = math.inf,
                pass_ms: Callable[[int], float] | None = None) -> BatchShape:
    """§7 with measured cost and gain: T = min over paced tiers in use of TPOT_l · gain_l (`idle_ms`
    when none decodes), at most `longest_ms` (the longest pass the engine runs); each batch holds
    time2bs(T) tokens, of which the decoders take Σ n_l · cost_l. With `pass_ms` (a pass's planned ms
    by its tokens) and paced decoders whose pass alone is shorter than T, the cycle whose long pass
    (at most `longest_ms`) feeds prompts fastest, where that beats batches of T by `CYCLE_GAIN` (of
    the cycles within `CYCLE_NEAR` of the fastest, the shortest: a long cycle holds prompts longer)."""
    paced = [t.tpot_ms * t.gain for n, t in zip(counts, tiers, strict=True) if n > 0 and t.paced]
    length = min(min(paced, default=idle_ms), longest_ms)
    decode = math.ceil(sum(n * t.cost for n, t in zip(counts, tiers, strict=True)) - EPS)
    uniform = BatchShape(length, int(time2bs(length) - decode), decode=decode)
    if pass_ms is None or not paced or not uniform.feasible:
        return uniform
    short = pass_ms(decode)
    if short >= length or longest_ms == math.inf:
        return uniform
    cycles = []
    k = int(math.floor((longest_ms - length) / (length - short) + EPS))
    while k >= 1:
        long_ms = (k + 1) * length - k * short
        cycles.append(BatchShape(length, uniform.prefill_per_batch, k, long_ms, int(time2bs(long_ms) - decode), decode))
        k //= 2
    best = max((c.rate for c in cycles), default=0.0)
    if best < CYCLE_GAIN * max(uniform.rate, 1.0):
        return uniform
    return min((c for c in cycles if c.rate >= CYCLE_NEAR * best), key=lambda c: c.cycle)


__all__ = ["BatchShape", "TierLoad", "batch_shape", "pb_closed_form", "pb_schedule"]
