"""The goodput model shared by `turbospec` and `slo-goodput`: expected tokens per step over step time.

Two parts, both fed by the IterationRecord (`observe`), both pure arithmetic (no I/O, no clock):

- `Acceptance`: the per-token acceptance rate a of chain drafts, estimated by the truncated-geometric
  MLE of the TurboSpec digest (§3, pitfalls): a = accepted / (accepted + rejections), where a
  rejection is a verify step that accepted fewer draft tokens than it proposed. accepted/proposed
  would be biased low (positions after the first rejection are never tested). Counts decay
  geometrically so the estimate follows drift; each request has its own counts, shrunk toward the
  global rate (digest errata 7).
- `StepTimeModel`: one iteration's time for a choice of draft depth d and width w on one replica,
  with our three-service path (digest §8):

      T(d) = [d > 0] (R_d + draft(d, n_spec, w, lag)) + R_t + target(N_tok) + T_gw

  `target` is the moving average of the replica's service time at each measured token count,
  interpolated between counts, and c0 + c1 * tokens (fitted from the profiled curve, refitted
  online) beyond them; `draft` is e0 + e1 d + e2 d n_spec w + e3 lag (lag: committed tokens the
  draft catches up in the call), fitted online from the draft's service time; R_d and R_t are
  moving averages of each call's round trip beyond the service's own time; T_gw the gateway's own
  share (schedule time). The fits are ridge regressions toward their priors with exponential
  forgetting, so a few iterations move them and old ones fade.

`l(a, k) = (1 - a^(k+1)) / (1 - a)` is the expected tokens of a k-token chain step (TurboSpec eq. 4).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from specserve.gateway.latency import LatencyModel
from specserve.gateway.record import IterationRecord

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

    def rate_of(self, rid: str) -> float:
        """The request's own MLE, shrunk toward the global rate by `prior_weight` pseudo-observations."""
        mine = self.per_request.get(rid)
        g = self.rate
        if mine is None:
            return g
        a = (mine[0] + g * self.prior_weight) / (mine[0] + mine[1] + self.prior_weight)
        return min(A_MAX, max(A_MIN, a))

    def forget(self, keep: set[str]) -> None:
        """Drop the counts of requests that are gone."""
        for rid in [r for r in self.per_request if r not in keep]:
            del self.per_request[rid]


class OnlineLinear:
    """y = theta . x, a ridge regression toward `prior` with exponential forgetting (closed form, small n)."""

    def __init__(self, prior: list[float], prior_weight: float = 1.0, decay: float = 0.98):
        self.prior = list(prior)
        self.prior_weight = prior_weight
        self.decay = decay
        n = len(prior)
        self.xtx = [[0.0] * n for _ in range(n)]
        self.xty = [0.0] * n
        self.theta = list(prior)

    def observe(self, x: list[float], y: float, weight: float = 1.0) -> None:
        n = len(self.prior)
        for i in range(n):
            self.xty[i] = self.xty[i] * self.decay + weight * x[i] * y
            row = self.xtx[i]
            for j in range(n):
                row[j] = row[j] * self.decay + weight * x[i] * x[j]
        self._solve()

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def _solve(self) -> None:
        n = len(self.prior)
        lam = self.prior_weight
        a = [[self.xtx[i][j] + (lam if i == j else 0.0) for j in range(n)] + [self.xty[i] + lam * self.prior[i]]
             for i in range(n)]
        for col in range(n):  # Gaussian elimination with partial pivoting; the ridge keeps it regular
            pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
            a[col], a[pivot] = a[pivot], a[col]
            p = a[col][col]
            if abs(p) < 1e-12:
                return
            for r in range(n):
                if r != col and a[r][col] != 0.0:
                    f = a[r][col] / p
                    a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
        self.theta = [max(0.0, a[i][n] / a[i][i]) for i in range(n)]  # no coefficient is negative time


def _ema(old: float, new: float, weight: float) -> float:
    return new if old < 0 else old + weight * (new - old)


class StepTimeModel:
    """One replica's iteration time as a function of the speculation choice (ms)."""

    def __init__(self, model: LatencyModel, draft_step_share: float = 0.15, smoothing: float = 0.2):
        c0, c1 = _line(model)
        # priors: the target line from the profile, weighted like a few dozen observations so the
        # online fit needs some data to move it; the draft's from a share of the batch-8 pass per beam step
        self.target = OnlineLinear([c0, c1], prior_weight=50.0)
        self.seen: dict[int, float] = {}  # tokens in a pass -> moving average of its service time, ms
        step = draft_step_share * max(model.baseline_iteration_ms, 1e-3)
        self.draft = OnlineLinear([0.5, step, step / 16, 0.05], prior_weight=2.0)
        self.smoothing = smoothing
        self.r_t = -1.0  # target round trip beyond its service time, ms (-1: not seen yet)
        self.r_d = -1.0  # draft round trip
        self.gateway = -1.0  # the gateway's own part of an iteration

    # ---- prediction ------------------------------------------------------------------------------
    def target_ms(self, tokens: int) -> float:
        """The pass over `tokens`: the measured time at that token count when there is one (moving
        average), else interpolated between the nearest measured counts, else the fitted line moved
        to pass through the nearest measured count. A line alone is wrong at small counts on a CPU,
        where a 1-token pass takes a cheap matrix-vector path (docs/benchmarks.md)."""
        seen = self.seen
        if tokens in seen:
            return seen[tokens]
        line = self.target.predict([1.0, float(tokens)])
        if not seen:
            return line
        keys = sorted(seen)
        i = bisect.bisect_left(keys, tokens)
        if 0 < i < len(keys):
            (x0, x1) = keys[i - 1], keys[i]
            return seen[x0] + (seen[x1] - seen[x0]) * (tokens - x0) / (x1 - x0)
        near = keys[0] if i == 0 else keys[-1]
        return max(1e-3, line + seen[near] - self.target.predict([1.0, float(near)]))

    def draft_ms(self, depth: int, spec: int, width: int, lag: int) -> float:
        return self.draft.predict([1.0, float(depth), float(depth * spec * width), float(lag)])

    def step_ms(self, depth: int, spec: int, width: int, tokens: int, lag: int = 0) -> float:
        """The iteration: draft call (if depth > 0 and anyone speculates), target pass over `tokens`, the rest."""
        t = max(self.r_t, 0.0) + self.target_ms(tokens) + max(self.gateway, 0.0)
        if depth > 0 and spec > 0:
            t += max(self.r_d, 0.0) + self.draft_ms(depth, spec, width, lag)
        return max(t, 1e-3)

    # ---- fitting -------------------------------------------------------------------------------
    def observe(self, record: IterationRecord, replica: int, depth: int, width: int, lag: int) -> None:
        """Refit from one iteration; depth/width/lag: what the draft call carried for this replica's batch."""
        mine = next((r for r in record.replicas if r.replica == replica and r.failure is None), None)
        if mine is None:
            return
        a = self.smoothing
        tokens = mine.prefill_tokens + mine.tree_nodes
        if tokens > 0 and mine.service_ms > 0:
            self.target.observe([1.0, float(tokens)], mine.service_ms)
            self.seen[tokens] = _ema(self.seen.get(tokens, -1.0), mine.service_ms, a)
            self.r_t = _ema(self.r_t, max(0.0, mine.call_ms - mine.service_ms), a)
        self.gateway = _ema(self.gateway, record.schedule_ms, a)
        d = record.draft
        if d.requests > 0 and d.failure is None and d.service_ms > 0 and depth > 0:
            self.draft.observe([1.0, float(depth), float(depth * d.requests * width), float(lag)], d.service_ms)
            self.r_d = _ema(self.r_d, max(0.0, d.call_ms - d.service_ms), a)


def _line(model: LatencyModel) -> tuple[float, float]:
    """c0 + c1 * tokens through the profiled curve (least squares); flat at the baseline without one."""
    pts = model.curve
    if len(pts) < 2:
        return model.baseline_iteration_ms, 0.0
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    c1 = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else 0.0
    c1 = max(0.0, c1)
    return max(0.0, my - c1 * mx), c1


def best_depth(goodput: dict[int, float], current: int, margin: float) -> int:
    """The argmax of predicted goodput over depths, kept at `current` unless the best predicts a gain
    above `margin` (relative) over it (TurboSpec digest pitfalls: oscillation)."""
    best = max(goodput, key=lambda k: (goodput[k], -k))
    if current in goodput and goodput[best] <= goodput[current] * (1.0 + margin):
        return current
    return best


__all__ = ["Acceptance", "OnlineLinear", "StepTimeModel", "best_depth", "expected_tokens"]
