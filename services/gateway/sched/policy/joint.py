"""`joint`: each iteration, who drafts and how deep, chosen together from SLO state and predicted goodput.

Per replica and iteration, from the seeds' models (goodput.py: the per-request
acceptance MLE and the three-service step-time model, refitted online):

1. Every decoding request has a *pace*: the ms per token it may take from now on and still meet
   its TPOT SLO, (tpot * (decoded + remaining) - elapsed) / remaining. At the predicted iteration
   time t it is
   - *lost* when not even a chain of K_max accepted whole every step could keep that pace: it
     never drafts (its root still runs). Only this best case condemns a request, never the
     estimated acceptance rate (why: docs/benchmarks/sweep_default.md, "The default: `joint`");
   - *at risk* when its root alone cannot keep its pace (t > pace);
   - *slack* otherwise.
2. Two options: the wide one, every request not lost drafting chains of TurboSpec's
   goodput-optimal length k in 0..K_max (tokens per ms of the whole pass, with its hysteresis); the
   narrow one, the at-risk requests alone drafting chains of the k of the best predicted *SLO
   goodput*: the expected tokens of the requests that keep their pace at the option's step time T
   (a chain of k yields l(a, k) tokens per T; a request that falls behind its pace counts nothing),
   over T. The narrow option wins only when its SLO goodput beats the wide one's. So under load,
   when drafting for everyone would make the pass too long for the requests at risk, the requests
   with slack keep their roots only and the tokens go to those at risk; when every request keeps
   its pace this is TurboSpec on the requests not lost.
3. k = 0 is the off switch (no draft call), with TurboSpec's draft-prefill skip and probes; every
   drafted chain is verified whole (the model prices chains, not trees).
"""

from __future__ import annotations

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.policy.base import BatchView, RequestView
from specserve.gateway.sched.policy.goodput import best_depth, expected_tokens
from specserve.gateway.sched.policy.turbospec import TurboSpec

LOST, AT_RISK, SLACK = "lost", "at_risk", "slack"


class Joint(TurboSpec):
    name = "joint"

    def state(self, r: RequestView, t_ms: float, pace: float | None = None) -> str:
        """LOST, AT_RISK or SLACK for a decoding request at a predicted iteration time of `t_ms` (pace: its
        `pace_ms()`, when the caller has it)."""
        pace = r.pace_ms() if pace is None else pace
        if pace * (self.control.max_k + 1) < t_ms:
            return LOST
        return AT_RISK if pace < t_ms else SLACK

    def value(self, batch: BatchView, model: PassCost, group: list[RequestView], k: int,
              rates: dict[str, float] | None = None, paces: dict[str, float] | None = None) -> float:
        """Predicted SLO goodput (tokens per ms) of this pass if the requests in `group` draft k-token chains
        (rates, paces: `Acceptance.rates` and `pace_ms()` of the batch's requests, when the caller prices
        several k)."""
        c = self.control
        ks, t = c.step_ms(batch, model, group, k)
        chains = {r.rid: kr for r, kr in zip(group, ks, strict=True)}
        rates = rates or c.acceptance.rates(batch.requests)
        paces = paces or {r.rid: r.pace_ms() for r in batch.requests}
        good = 0.0
        for r in batch.requests:
            tokens = expected_tokens(rates[r.rid], chains.get(r.rid, 0))
            if t <= paces[r.rid] * tokens:
                good += tokens
        return good / t

    def choose(self, batch: BatchView, model: PassCost) -> tuple[int, list[RequestView]]:
        """(k, the requests that draft k-token chains): the wider option unless the narrow one's
        predicted SLO goodput is higher."""
        c = self.control
        t = model.t_spec_ms
        ready, late = c.eligible(batch)
        allowed = {r.rid for r in ready + late}
        paces = {r.rid: r.pace_ms() for r in batch.requests}  # once, as the rates: every k is priced with them
        states = {r.rid: self.state(r, t, paces[r.rid]) for r in batch.requests}
        may = [r for r in batch.requests if r.rid in allowed and r.remaining > 1 and states[r.rid] != LOST]
        current = c.current.get(batch.replica, 0)
        rates = c.acceptance.rates(batch.requests) if may else {}
        wide = {k: c.goodput(batch, model, may, k, rates) for k in range(c.max_k + 1)} if may else {0: 0.0}
        k, spec = best_depth(wide, current, c.margin), may
        narrow = [r for r in may if states[r.rid] == AT_RISK]
        if narrow and len(narrow) < len(may):
            table = {k: self.value(batch, model, narrow, k, rates, paces) for k in range(c.max_k + 1)}
            k_narrow = best_depth(table, current, c.margin)
            if table[k_narrow] > self.value(batch, model, may, k, rates, paces) * (1.0 + c.margin):
                k, spec = k_narrow, narrow
        drafting = {r.rid for r in spec}
        c.settle(batch, k, [r for r in late if r.rid in drafting], may)
        return k, spec if k > 0 else may  # at k = 0 nobody drafts; TurboSpec's probe picks among `may`


__all__ = ["AT_RISK", "Joint", "LOST", "SLACK"]
