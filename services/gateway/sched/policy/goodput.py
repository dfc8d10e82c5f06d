"""The goodput model shared by `turbospec` and `slo-goodput`: expected tokens per step over step time.

The step time T(k) is the replica's `PassCost` (cost.py, the gateway's one cost model). The part
here is fed by the IterationRecord (`observe`) and is pure arithmetic (no I/O, no clock):

- `Acceptance`: the per-token acceptance rate a of chain drafts, estimated by the truncated-geometric
  MLE of the TurboSpec digest (§3, pitfalls): a = accepted / (accepted + rejections), where a
  rejection is a verify step that accepted fewer draft tokens than it proposed. accepted/proposed
  would be biased low (positions after the first rejection are never tested). Counts decay
  geometrically so the estimate follows drift; each request has its own counts, shrunk toward the
  global rate (digest errata 7).

- `Chains`: one replica's decoding requests as arrays (remaining tokens, draft lag, acceptance rate,
  pace), priced for k-token chains at every k in 0..K_max at once: the step time T(k) and the goodput
  G(k) of a group of them drafting, one numpy expression per table instead of a loop per request and k.

`l(a, k) = (1 - a^(k+1)) / (1 - a)` is the expected tokens of a k-token chain step (TurboSpec eq. 4).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.plan import BatchView, RequestView

A_MIN, A_MAX = 0.01, 0.99  # the estimate is clamped: eq. 4 is singular at a = 1 (digest errata 9)


def expected_tokens(a: float, k: int) -> float:
    """l(a, k): expected tokens (accepted + the target's own) of a step with k chain draft tokens."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def chain_tokens(a: np.ndarray, k: np.ndarray) -> np.ndarray:
    """`expected_tokens` elementwise over arrays of rates and chain lengths (broadcast)."""
    k = np.maximum(k, 0)
    below = a < 1.0
    return np.where(below, (1.0 - a ** (k + 1)) / np.where(below, 1.0 - a, 1.0), k + 1.0)  # k = 0: (1 - a) / (1 - a)


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

    def rate_of(self, rid: str) -> float:
        """The request's own MLE, shrunk toward the global rate by `prior_weight` pseudo-observations."""
        mine = self.per_request.get(rid)
        g = self.rate
        if mine is None:
            return g
        a = (mine[0] + g * self.prior_weight) / (mine[0] + mine[1] + self.prior_weight)
        return min(A_MAX, max(A_MIN, a))

    def rates(self, rids: list[str]) -> np.ndarray:
        """`rate_of` of every request in `rids`, as an array."""
        g, w = self.rate, self.prior_weight
        none = (0.0, 0.0)
        counts = np.array([self.per_request.get(rid, none) for rid in rids], dtype=np.float64).reshape(-1, 2)
        known = np.fromiter((rid in self.per_request for rid in rids), bool, len(rids))
        mine = (counts[:, 0] + g * w) / (counts.sum(axis=1) + w)
        return np.where(known, np.minimum(np.maximum(mine, A_MIN), A_MAX), g)

    def forget(self, keep: AbstractSet[str]) -> None:
        """Drop the counts of requests that are gone."""
        for rid in [r for r in self.per_request if r not in keep]:
            del self.per_request[rid]


class Chains:
    """One replica's batch priced for k-token chains, for every k in 0..max_k at once.

    A request of the drafting group draft min(k, remaining - 1) tokens; the others verify their root
    alone (one token). Tables are indexed by k.
    """

    def __init__(self, batch: BatchView, cost: PassCost, acceptance: Acceptance, max_k: int):
        reqs = batch.requests
        n = len(reqs)
        self.batch, self.cost, self.n = batch, cost, n
        self.index = {r.rid: i for i, r in enumerate(reqs)}
        remaining = np.fromiter((r.remaining for r in reqs), np.int64, n)
        self.lag = np.fromiter((r.draft_lag for r in reqs), np.int64, n)
        self.rate = acceptance.rates([r.rid for r in reqs])
        self.pace = np.fromiter((r.pace_ms() for r in reqs), np.float64, n)  # RequestView.pace_ms
        self.kv = sum(r.kv_blocks for r in reqs)
        self.ks = np.minimum(np.arange(max_k + 1)[:, None], remaining[None, :] - 1)  # (k, request): its chain
        self.tokens = chain_tokens(self.rate[None, :], self.ks)  # l(a_i, k_i)
        self._steps: dict[bytes, np.ndarray] = {}

    def mask(self, group: list[RequestView]) -> np.ndarray:
        """The requests of `group` as a boolean vector over the batch."""
        m = np.zeros(self.n, dtype=bool)
        m[[self.index[r.rid] for r in group]] = True
        return m

    def chains(self, group: np.ndarray) -> np.ndarray:
        """(k, request): the draft tokens each request drafts when `group` drafts k-token chains."""
        return np.where(group[None, :], self.ks, 0)

    def step_ms(self, group: np.ndarray) -> np.ndarray:
        """T(k): the predicted time of this replica's iteration when `group` drafts k-token chains."""
        key = np.packbits(group).tobytes()
        if key not in self._steps:
            ks = self.chains(group)
            drafting = ks > 0
            total, spec, lag = ks.sum(axis=1), drafting.sum(axis=1), drafting @ self.lag
            deepest = ks.max(axis=1) if self.n else np.zeros(len(ks), dtype=np.int64)
            tokens = self.n + self.batch.prefill_tokens + total
            self._steps[key] = self.cost.iteration_ms_many(tokens, deepest, spec, 1, lag, self.kv)
        return self._steps[key]

    def yields(self, group: np.ndarray) -> np.ndarray:
        """(k, request): expected tokens of each request's step when `group` drafts k-token chains."""
        return np.where(group[None, :], self.tokens, 1.0)

    def goodput(self, group: np.ndarray) -> np.ndarray:
        """G(k): predicted tokens per ms of this replica's pass when `group` drafts k-token chains."""
        goodput: np.ndarray = self.yields(group).sum(axis=1) / self.step_ms(group)
        return goodput


def best_depth(goodput: dict[int, float], current: int, margin: float) -> int:
    """The argmax of predicted goodput over depths, kept at `current` unless the best predicts a gain
    above `margin` (relative) over it (TurboSpec digest pitfalls: oscillation)."""
    best = max(goodput, key=lambda k: (goodput[k], -k))
    if current in goodput and goodput[best] <= goodput[current] * (1.0 + margin):
        return current
    return best


__all__ = ["Acceptance", "Chains", "best_depth", "chain_tokens", "expected_tokens"]
