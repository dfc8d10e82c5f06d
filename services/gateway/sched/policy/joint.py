"""`joint`: each iteration, who drafts and how deep, chosen together from SLO state and predicted goodput.

Per replica and iteration (issue 30, part 2), from the seeds' models (goodput.py: the per-request
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

import numpy as np

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.policy.base import BatchView, RequestView
from specserve.gateway.sched.policy.goodput import Chains, best_depth
from specserve.gateway.sched.policy.turbospec import TurboSpec

LOST, AT_RISK, SLACK = "lost", "at_risk", "slack"


class Joint(TurboSpec):
    name = "joint"

    def states(self, chains: Chains, t_ms: float) -> np.ndarray:
        """LOST, AT_RISK or SLACK of every request of the batch at a predicted iteration time of `t_ms`."""
        pace = chains.pace
        return np.where(pace * (self.control.max_k + 1) < t_ms, LOST, np.where(pace < t_ms, AT_RISK, SLACK))

    def value(self, chains: Chains, group: np.ndarray) -> np.ndarray:
        """Predicted SLO goodput (tokens per ms) of this pass, per k, if the requests in `group` draft
        k-token chains: the tokens of the requests that keep their pace at that pass's time, over it."""
        t = chains.step_ms(group)
        tokens = chains.yields(group)
        kept = t[:, None] <= chains.pace[None, :] * tokens
        good: np.ndarray = np.where(kept, tokens, 0.0).sum(axis=1) / t
        return good

    def choose(self, batch: BatchView, model: PassCost) -> tuple[int, list[RequestView]]:
        """(k, the requests that draft k-token chains): the wider option unless the narrow one's
        predicted SLO goodput is higher."""
        c = self.control
        ready, late = c.eligible(batch)
        allowed = {r.rid for r in ready + late}
        chains = c.prices(batch, model)
        states = self.states(chains, model.t_spec_ms)
        may = [r for i, r in enumerate(batch.requests)
               if r.rid in allowed and r.remaining > 1 and states[i] != LOST]
        current = c.current.get(batch.replica, 0)
        wide = dict(enumerate(chains.goodput(chains.mask(may)).tolist())) if may else {0: 0.0}
        k, spec = best_depth(wide, current, c.margin), may
        narrow = [r for r in may if states[chains.index[r.rid]] == AT_RISK]
        if narrow and len(narrow) < len(may):
            values = self.value(chains, chains.mask(narrow))
            k_narrow = best_depth(dict(enumerate(values.tolist())), current, c.margin)
            if values[k_narrow] > self.value(chains, chains.mask(may))[k] * (1.0 + c.margin):
                k, spec = k_narrow, narrow
        drafting = {r.rid for r in spec}
        c.settle(batch, k, [r for r in late if r.rid in drafting], may)
        return k, spec if k > 0 else may  # at k = 0 nobody drafts; TurboSpec's probe picks among `may`


__all__ = ["AT_RISK", "Joint", "LOST", "SLACK"]
