"""LatencyModel: what a policy may know about time: the profiled budget and curve, plus live estimates.

The budget B and the target's latency curve come from `specserve profile` (profile.py). The
per-iteration latency t_spec that AdaServe's A(r) needs is predicted as a moving average of the
measured iterations, seeded with the profiled baseline iteration latency.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from specserve.gateway.record import IterationRecord


@dataclass(slots=True)
class LatencyModel:
    budget_tokens: int  # B: tokens per target pass, roots included
    baseline_iteration_ms: float  # min iteration latency of plain decoding at batch 8 (the profile's)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens in a target pass, median ms)
    smoothing: float = 0.2  # weight of the newest iteration in the moving average
    t_spec_ms: float = 0.0  # predicted latency of the next full iteration, ms
    draft_ms: float = 0.0  # moving average of the draft call per iteration that speculated, ms
    target_ms: float = 0.0  # moving average of the target call, ms

    def __post_init__(self) -> None:
        if self.t_spec_ms <= 0:
            self.t_spec_ms = self.baseline_iteration_ms

    def observe(self, iteration_ms: float, draft_ms: float, target_ms: float) -> None:
        a = self.smoothing
        self.t_spec_ms += a * (iteration_ms - self.t_spec_ms)
        self.target_ms = target_ms if self.target_ms == 0 else self.target_ms + a * (target_ms - self.target_ms)
        if draft_ms > 0:
            self.draft_ms = draft_ms if self.draft_ms == 0 else self.draft_ms + a * (draft_ms - self.draft_ms)

    def observe_record(self, record: IterationRecord, replica: int) -> None:
        """One iteration as this replica saw it: the whole iteration, the draft call, its own Forward."""
        mine = next((r for r in record.replicas if r.replica == replica and r.failure is None), None)
        if mine is None or not any(s.replica == replica and s.verified for s in record.requests):
            return  # no decoding on this replica: the iteration says nothing about t_spec
        self.observe(record.total_ms, record.draft.call_ms, mine.call_ms)

    def predict_target_ms(self, tokens: int) -> float:
        """Linear interpolation on the profiled curve (flat below it, linear extrapolation above)."""
        if not self.curve:
            return self.baseline_iteration_ms
        xs = [t for t, _ in self.curve]
        i = bisect.bisect_left(xs, tokens)
        if i == 0:
            return self.curve[0][1]
        if i == len(xs):
            i -= 1
        (x0, y0), (x1, y1) = self.curve[max(i - 1, 0)], self.curve[i]
        if x1 == x0:
            return y1
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
