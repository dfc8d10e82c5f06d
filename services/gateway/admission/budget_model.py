"""One replica's PB* for the DP: the roofline, the tiers' measured cost and gain, memoised per call.

Plain decoding (every tier costs and yields one token per pass) uses the closed form of Algorithm 2
(digest §6); with speculation the §7 form with measured per-tier cost and gain (budget.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specserve.gateway.admission.budget import EPS, BatchShape, TierLoad, batch_shape
from specserve.gateway.admission.dp import Budget
from specserve.gateway.admission.roofline import Roofline


class ReplicaBudget:
    def __init__(self, roofline: Roofline, tiers: Sequence[TierLoad], idle_ms: float, spec_steps: int = 0):
        self.roofline = roofline
        self.tiers = list(tiers)
        self.idle_ms = idle_ms  # batch length when nothing decodes: the tightest TPOT offered
        self.spec_steps = spec_steps
        self.plain = all(t.cost == 1.0 and t.gain == 1.0 for t in self.tiers)
        self._shapes: dict[tuple[int, ...], BatchShape] = {}
        self._caps: dict[float, int] = {}

    def cap(self, length_ms: float) -> int:
        c = self._caps.get(length_ms)
        if c is None:
            c = self._caps[length_ms] = self.roofline.time2bs(length_ms, self.spec_steps)
        return c

    def shape(self, decoders: tuple[int, ...]) -> BatchShape:
        s = self._shapes.get(decoders)
        if s is None:
            s = self._shapes[decoders] = batch_shape(decoders, self.tiers, self.cap, self.idle_ms)
        return s

    def window(self, ms: float, decoders: tuple[int, ...]) -> int | None:
        if ms <= 0:
            return 0
        if not self.plain:
            s = self.shape(decoders)
            return s.budget(ms) if s.feasible else None
        t0 = min((t.tpot_ms for n, t in zip(decoders, self.tiers, strict=True) if n > 0), default=self.idle_ms)
        batches = int(math.floor(ms / t0 + EPS))
        if batches == 0:
            return 0
        cap = self.cap(t0)
        if sum(decoders) > cap:
            return None
        due = sum(n * (int(math.floor((batches - 1) * t0 / t.tpot_ms + EPS)) + 1)
                  for n, t in zip(decoders, self.tiers, strict=True) if n)
        return batches * cap - due

    def sustainable(self, decoders: tuple[int, ...]) -> bool:
        return self.shape(decoders).feasible

    def as_budget(self) -> Budget:
        return Budget(self.window, self.sustainable)


__all__ = ["ReplicaBudget"]
