"""PB*: the prefill budget a time window can supply after the decode SLOs are paid (digest §§6-7).

Batches last t0 = the tightest TPOT among the decoding requests and each holds `cap` = time2bs(t0)
tokens. Decode tokens are handed out earliest-due-first; what a batch has left is its prefill
budget. `None` means infeasible: some batch cannot hold the decode tokens due in it.

- `pb_schedule`: Algorithm 2 as corrected in the digest (errata 1-3), one request at a time on a heap;
- `pb_closed_form`: the same number in O(tiers), the form the planner uses (budget_model.py);
- `TierLoad` / `BatchShape`: the speculative variant of §7 with our measured per-tier cost (tree
  nodes verified per request per pass) and yield (tokens emitted per pass) in place of Acc(sl):
  a batch may last T = min_l TPOT_l · yield_l, and holds time2bs(T) − Σ_l n_l · cost_l prefill tokens.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

EPS = 1e-9  # ms: due times that agree to this are equal


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
    """The batches a set of decoders allows: their length and the prefill tokens each can carry."""

    length_ms: float  # T: one batch, ms
    prefill_per_batch: int  # tokens left for prompts in each batch (negative: the decoders do not fit)

    @property
    def feasible(self) -> bool:
        return self.prefill_per_batch >= 0

    def budget(self, window_ms: float) -> int:
        """The prefill tokens of the whole batches that fit in the window."""
        return int(math.floor(window_ms / self.length_ms + EPS)) * self.prefill_per_batch


def batch_shape(counts: Sequence[int], tiers: Sequence[TierLoad], time2bs: Callable[[float], int],
                idle_ms: float, longest_ms: float = math.inf) -> BatchShape:
    """§7 with measured cost and gain: T = min over paced tiers in use of TPOT_l · gain_l (`idle_ms`
    when none decodes), at most `longest_ms` (the longest pass the engine runs); each batch holds
    time2bs(T) tokens, of which the decoders take Σ n_l · cost_l."""
    length = min(min((t.tpot_ms * t.gain for n, t in zip(counts, tiers, strict=True) if n > 0 and t.paced),
                     default=idle_ms), longest_ms)
    decode = sum(n * t.cost for n, t in zip(counts, tiers, strict=True))
    return BatchShape(length, int(time2bs(length) - math.ceil(decode - EPS)))


__all__ = ["BatchShape", "TierLoad", "batch_shape", "pb_closed_form", "pb_schedule"]
