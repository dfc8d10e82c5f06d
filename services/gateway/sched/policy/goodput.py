"""The goodput model shared by `turbospec` and `slo-goodput`: expected tokens per step over step time.

The step time T(k) is the replica's `PassCost` (cost.py, the gateway's one cost model). The part
here is fed by the IterationRecord (`observe`) and is pure arithmetic (no I/O, no clock):

- `Acceptance`: the per-token acceptance rate a of chain drafts, estimated by the truncated-geometric
  MLE of the TurboSpec digest (§3, pitfalls): a = accepted / (accepted + rejections), where a
  rejection is a verify step that accepted fewer draft tokens than it proposed. accepted/proposed
  would be biased low (positions after the first rejection are never tested). Counts decay
  geometrically so the estimate follows drift; each request has its own counts, shrunk toward the
  global rate (digest errata 7).

`l(a, k) = (1 - a^(k+1)) / (1 - a)` is the expected tokens of a k-token chain step (TurboSpec eq. 4).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from specserve.gateway.sched.plan import RequestView

A_MIN, A_MAX = 0.01, 0.99  # the estimate is clamped: eq. 4 is singular at a = 1 (digest errata 9)


def expected_tokens(a: float, k: int) -> float:
    """l(a, k): expected tokens (accepted + the target's own) of a step with k chain draft tokens."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(slots=True)
class Acceptance:
    """Truncated-geometric MLE of the per-token acceptance rate, global and per request."""

    prior: float = 0.6  # A0: the rate before any observation (digest §5)
    prior_weight: float = 4.0  # pseudo-observations of the prior, globally and for each request
    decay: float = 0.98  # weight kept by the older counts at every verify step (about 50 steps of memory)
    accepted: float = 0.0  # decayed accepted draft tokens
    rejected: float = 0.0  # decayed verify steps that stopped before their last draft token
    per_request: dict[str, list[float]] = field(default_factory=dict)  # rid -> [accepted, rejected]

    def observe(self, rid: str, proposed: int, accepted: int) -> None:
        """One verify step: `proposed` draft tokens in a chain (or a tree's deepest level), `accepted` of them."""
        if proposed <= 0:
            return
        accepted = max(0, min(accepted, proposed))
        rejected = 1.0 if accepted < proposed else 0.0
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + rejected
        mine = self.per_request.setdefault(rid, [0.0, 0.0])
        mine[0] += accepted
        mine[1] += rejected

    @property
    def rate(self) -> float:
        a = (self.accepted + self.prior * self.prior_weight) / (self.accepted + self.rejected + self.prior_weight)
        return min(A_MAX, max(A_MIN, a))

    def rate_of(self, rid: str, g: float | None = None) -> float:
        """The request's own MLE, shrunk toward the global rate `g` (default: `rate`) by `prior_weight`
        pseudo-observations."""
        mine = self.per_request.get(rid)
        if g is None:
            g = self.rate
        if mine is None:
            return g
        a = (mine[0] + g * self.prior_weight) / (mine[0] + mine[1] + self.prior_weight)
        return min(A_MAX, max(A_MIN, a))

    def rates(self, requests: list[RequestView]) -> dict[str, float]:
        """`rate_of` of each request, the global rate computed once (a plan prices every k with them)."""
        g = self.rate
        return {r.rid: self.rate_of(r.rid, g) for r in requests}

    def forget(self, keep: AbstractSet[str]) -> None:
        """Drop the counts of requests that are gone."""
        for rid in [r for r in self.per_request if r not in keep]:
            del self.per_request[rid]


def best_depth(goodput: dict[int, float], current: int, margin: float) -> int:
    """The argmax of predicted goodput over depths, kept at `current` unless the best predicts a gain
    above `margin` (relative) over it (TurboSpec digest pitfalls: oscillation)."""
    best = max(goodput, key=lambda k: (goodput[k], -k))
    if current in goodput and goodput[best] <= goodput[current] * (1.0 + margin):
        return current
    return best


__all__ = ["Acceptance", "best_depth", "expected_tokens"]
