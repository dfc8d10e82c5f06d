"""One replica's PB* for the DP: its cost model's time2bs, the tiers' measured cost and gain, memoised per call.

Our engine puts every decoding request in every target pass (continuous batching), so in the
digest's terms every decoder is due in every batch, whatever its TPOT: a looser tier does not free
budget by skipping batches, it only lengthens the batch it may ride. Plain decoding (every tier
costs and yields one token per pass) is therefore the closed form of Algorithm 2 with every TPOT_r
= t0, i.e. B·(time2bs(t0) − n); with speculation it is the §7 form with the measured per-tier cost
and gain (budget.py). The batch length with nothing decoding is `idle_ms`, and no batch is longer than
`longest_ms`, the planned time of the largest pass the engine runs (its prefill cap beside its
decoders): a loose TPOT (say 100 s) does not make one pass of 100 s, the engine runs many short ones,
so a prompt's TTFT is met within a fraction of that TPOT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.admission.budget import BatchShape, TierLoad, batch_shape, pb_closed_form
from specserve.gateway.sched.admission.dp import Budget, Node, plan


class ReplicaBudget:
    def __init__(self, cost: PassCost, tiers: Sequence[TierLoad], idle_ms: float, spec_steps: int = 0,
                 kv_blocks: int = 0, longest_ms: float = math.inf):
        self.cost = cost
        self.longest_ms = longest_ms
        self.kv_blocks = kv_blocks  # KV blocks the replica's requests will hold: the context its passes attend to
        self.tiers = list(tiers)
        self.idle_ms = idle_ms  # batch length when nothing decodes
        self.spec_steps = spec_steps
        self.plain = all(t.cost == 1.0 and t.gain == 1.0 for t in self.tiers)
        self._shapes: dict[tuple[int, ...], BatchShape] = {}
        self._caps: dict[tuple[float, int], int] = {}

    def attending(self, kv_blocks: int) -> ReplicaBudget:
        """The same replica and tiers with its passes attending to `kv_blocks` (a fresh memo)."""
        return ReplicaBudget(self.cost, self.tiers, self.idle_ms, self.spec_steps, kv_blocks, self.longest_ms)

    def cap(self, length_ms: float, spec_steps: int | None = None) -> int:
        """Tokens one pass of `length_ms` holds, with the draft call of `spec_steps` (default: the
        replica's moving average; 0 when nothing decodes, so nothing drafts)."""
        steps = self.spec_steps if spec_steps is None else spec_steps
        c = self._caps.get((length_ms, steps))
        if c is None:
            c = self._caps[(length_ms, steps)] = self.cost.time2bs(length_ms, steps, self.kv_blocks)
        return c

    def _steps(self, decoders: tuple[int, ...]) -> int:
        """The draft call's depth in a pass with these decoders: none when nothing decodes."""
        return self.spec_steps if any(decoders) else 0

    def shape(self, decoders: tuple[int, ...]) -> BatchShape:
        s = self._shapes.get(decoders)
        if s is None:
            steps = self._steps(decoders)
            s = self._shapes[decoders] = batch_shape(decoders, self.tiers, lambda ms: self.cap(ms, steps),
                                                     self.idle_ms, self.longest_ms)
        return s

    def window(self, ms: float, decoders: tuple[int, ...]) -> int | None:
        if ms <= 0:
            return 0
        if not self.plain:
            s = self.shape(decoders)
            return s.budget(ms) if s.feasible else None
        t0 = min(min((t.tpot_ms for n, t in zip(decoders, self.tiers, strict=True) if n > 0 and t.paced),
                     default=self.idle_ms), self.longest_ms)
        return pb_closed_form(ms, [(t0, sum(decoders))], self.cap(t0, self._steps(decoders)), t0)

    def sustainable(self, decoders: tuple[int, ...]) -> bool:
        return self.shape(decoders).feasible

    def as_budget(self) -> Budget:
        return Budget(self.window, self.sustainable)


def best_plan(nodes: list[Node], base: list[int], blocks: int, points: list[ReplicaBudget]) -> set[str]:
    """The DP's admissions at the first operating point that admits the most (ties: the earlier)."""
    best: set[str] = set()
    for i, b in enumerate(points):
        took = set(plan(nodes, base, blocks, b.as_budget()).admitted)
        if i == 0 or len(took) > len(best):
            best = took
        if len(best) == sum(not n.forced for n in nodes):
            break
    return best


__all__ = ["ReplicaBudget", "best_plan"]
