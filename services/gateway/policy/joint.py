"""`joint`: each iteration, who drafts and how deep, chosen together by SLO state and predicted goodput.

Per replica and iteration (issue 30, part 2; the seeds' parts, nothing new in the models):

1. Every decoding request is classed by its TPOT SLO at the predicted iteration time t
   (LatencyModel.t_spec_ms):
   - *lost*: it misses its SLO even if every remaining step yields the most a chain of K_max can
     (`hopeless`, slo_goodput.py). It never drafts; its root still runs (the output continues).
   - *at risk*: AdaServe's A(r) > 1, i.e. one token this step leaves it behind its SLO.
   - *slack*: A(r) <= 1: its root alone keeps it on its SLO.
2. The drafting set is the at-risk requests when there are any, else the slack ones: while someone
   is at risk, a request with slack verifies its root only, so the pass and the draft call carry
   only tokens that buy SLOs.
3. The chain length k for that set is TurboSpec's (this class is TurboSpec with the set narrowed):
   the k in 0..K_max of the best predicted goodput of the whole pass (GoodputControl, goodput.py:
   per-request acceptance MLE, the step-time model at the running batch), 0 = no draft call (the
   off switch), with its draft-prefill skip under load and its probes. The pass's budget is
   therefore n + the set's chains, chosen with the set at the running batch, not profiled once
   (AdaServe's fixed B left about one token per request under load).
4. Every drafted chain is verified whole (the goodput model prices chains, not trees).

Why chains of k and not k + e (slo-goodput): at the simulated 7B cliff the extra token was most
of slo-goodput's loss to turbospec (docs/benchmarks.md, "The papers' setting").
"""

from __future__ import annotations

from specserve.gateway.latency import LatencyModel
from specserve.gateway.policy.base import BatchView, RequestView
from specserve.gateway.policy.goodput import expected_tokens
from specserve.gateway.policy.slo_goodput import hopeless
from specserve.gateway.policy.turbospec import TurboSpec

LOST, AT_RISK, SLACK = "lost", "at_risk", "slack"


class Joint(TurboSpec):
    name = "joint"

    def state(self, r: RequestView, t_ms: float) -> str:
        """LOST, AT_RISK or SLACK for a decoding request at a predicted iteration time of `t_ms`."""
        c = self.control
        if hopeless(r, t_ms, expected_tokens(c.acceptance.rate_of(r.rid), c.max_k)):
            return LOST
        return AT_RISK if r.required(t_ms) > 1.0 else SLACK

    def candidates(self, batch: BatchView, model: LatencyModel) -> list[RequestView] | None:
        """The at-risk requests if there are any, else the slack ones; never the lost."""
        states = [(r, self.state(r, model.t_spec_ms)) for r in batch.requests]
        at_risk = [r for r, s in states if s == AT_RISK]
        return at_risk or [r for r, s in states if s == SLACK]


__all__ = ["AT_RISK", "Joint", "LOST", "SLACK"]
