"""SLO-aware admission (SLOs-Serve): the scheduler's proposal stage when `--admission slo`.

`SloAdmission` keeps what lasts across iterations (each request's tier, the best-effort set, what the
speculation policy measured per tier); each iteration's plan is a `slo_round.SloRound`, in named steps.

Each iteration, for each target replica, a planner (dp.py over budget_model.py) takes the replica's
decoding requests (a constant per tier, at the pace they may all keep: a TPOT is a mean over a
request's tokens, so decoders ahead of it allow longer batches until a new request's first token),
its requests still prefilling (forced nodes) and the new requests offered to it, and admits the
largest set whose TTFT and TPOT SLOs can all be met. Soft admission (digest §8):

1. each new request is offered first to the replica the router picks for it (so one iteration's
   arrivals spread as under FIFO); one that replica declines is offered to the others with
   `--router slo` (every replica, in a rotating order); with `round-robin` / `least-loaded` only the
   router's pick is asked;
2. then, if it allows best effort (`service_tier: "flex"`), it waits in the best-effort tier and is
   admitted when a replica can take it with no TTFT bound at the loosest TPOT, and always by a
   replica with nothing to run (work conserving: whatever the model says, an idle replica is spare);
3. otherwise it is refused at once: 503 with a Retry-After from the plan (when the soonest running
   request on any replica is expected to finish). One that cannot meet its TTFT even with every
   replica's passes given to the prompts due before it (`arrival.first_token_bound_ms`) is refused on arrival;
   of the queue behind the offer, the first `LOOKAHEAD` are decided in the same plan, greedily in
   arrival order: each admitted where a replica takes it alone beside every request ahead of it, else
   refused, so that a request learns its fate at the first plan that sees it.

A best-effort request, once admitted, is planned as a decoder with no TPOT: it costs its tokens in
every batch but never sets the batch length.

Prompt chunks come from the plan: each replica's batch holds time2bs(T) tokens, the decoders take
theirs, and the rest goes to prompts in prefill-deadline order; at least as many as keep every prompt
not yet late within its deadline (the prompts due by it, over the batches of length T before it), at
most the engine's chunk. The floor is there because the plan counts a request as a decoder from its
prefill deadline, while the engine decodes it as soon as its prompt is in, which shrinks the batches
left for the prompts after it.

Batch lengths come from each replica's `PassCost` (cost.py: the gateway's one cost model, the same
the speculation policy prices its choices with, fed by the engine); each tier's cost
(nodes per pass) and gain (tokens per pass) are moving averages of what the speculation policy in use
really did, less the nodes it added only from a pass's slack (`Policy.filler`: `joint`'s side
branches, which more decoders crowd out). No I/O, no clock.

Each replica is planned at two operating points, and a request is admitted if either admits it: the
measured one (each tier's cost and gain as above, every pass priced with the draft call's moving
depth) and plain decoding (one node and one token per request, no draft call), which the speculation
policy can always fall back to (`joint` turns drafting off when it would push a request past its
pace). The measured point alone can price a tier's small measured gain together with a draft call in
every pass, and refuse a request that plain passes would serve. At the plain point prompts are prefilled
first: while nothing decodes its batches are the engine's largest pass, so a critical request that
arrives while a long prompt prefills is planned with both prompts in a few large passes and its decoding
after, not in batches of its TPOT from the start. Prompt chunks come from whichever point's batches hold
the replica's decoders with the most room.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.admission.arrival import first_token_bound_ms
from specserve.gateway.sched.admission.budget import TierLoad
from specserve.gateway.sched.admission.slo_round import (
    BEST_EFFORT_TPOT_MS,
    AdmissionCounts,
    SloRound,
    retry_after,
)
from specserve.gateway.sched.plan import Proposal, ReplicaView, SchedulerView, WaitingView
from specserve.gateway.sched.policy.goodput import Acceptance


@dataclass(slots=True)
class TierStats:
    cost: float = 1.0  # nodes verified per request per pass (moving average)
    gain: float = 1.0  # tokens emitted per request per pass (moving average)


class SloAdmission:
    name = "slo"

    def __init__(self, *, route_all: bool = True, max_new: int = 8, memory_buckets: int = 16,
                 smoothing: float = 0.1):
        self.route_all = route_all  # offer a declined request to every replica (SLO-aware routing)
        self.max_new = max_new  # new requests offered per iteration (the DP's complexity budget, digest)
        self.memory_buckets = memory_buckets
        self.smoothing = smoothing
        self.stats: dict[float, TierStats] = {}  # by TPOT, ms
        self.tier_of: dict[str, float] = {}  # rid -> its TPOT, ms (for observe)
        self.best_effort: set[str] = set()  # rids admitted in the best-effort tier
        self.spec_steps = 0.0  # moving average of the deepest beam per iteration
        self.spec_prior = (1.0, 1.0)  # (nodes, tokens) per pass the policy can give a tier that needs it
        self.acceptance = Acceptance()  # per-token acceptance of the drafted steps, whatever the policy
        self.last = AdmissionCounts()
        self.rotation = 0  # rotating first replica (SLO-aware routing)

    def observe(self, record: IterationRecord) -> None:
        a = self.smoothing
        depth = 0
        for s in record.verify_steps:
            depth = max(depth, s.depth)
            if s.depth > 0 and s.verified > 1:  # drafted: its deepest level's tokens were offered
                self.acceptance.observe(s.rid, min(s.depth, s.verified - 1), s.accepted)
            tpot = self.tier_of.get(s.rid)
            if tpot is None:
                continue
            st = self.stats.setdefault(tpot, TierStats())
            st.cost += a * (s.verified - s.filler - st.cost)
            st.gain += a * (max(s.emitted, 1) - st.gain)
        self.spec_steps += a * (depth - self.spec_steps)

    # ---- the proposal --------------------------------------------------------------------------
    def propose(self, view: SchedulerView, best_effort_ok: set[str], first: Mapping[str, int] | None) -> Proposal:
        """Admissions, deferrals, rejections and prompt chunks for this iteration. `first`: the replica the
        router picks for each waiting request, asked first (absent: this plan's rotating first replica)."""
        self._prune(view)
        plan = SloRound(self, view, best_effort_ok, first)
        plan.serve_declined(plan.offer_new())
        plan.decide_queue()
        return plan.proposal()

    def alone(self, w: WaitingView, up: list[ReplicaView], chunk: int) -> bool:
        """Whether a replica with nothing else to run could meet the request's SLO (its cost model: the
        prompt in passes of `chunk`, then decode passes of one token or of the policy's prior)."""
        nodes, tokens = self.spec_prior
        return any(w.waited_ms + first_token_bound_ms(w.uncached(rep.index), 0, [rep.cost], chunk) <= w.ttft_ms
                   and min(rep.cost.planned_ms(1), rep.cost.planned_ms(math.ceil(nodes), 1) / tokens) <= w.tpot_ms
                   for rep in up)

    def load(self, tpot: float, prior: bool, pace: float) -> TierLoad:
        """A tier's measured cost and gain, its batches paced at `pace` ms per token (its TPOT, or
        slower where its decoders are ahead of it); with `prior` (its batch cannot hold two tokens without
        speculation, and none of its requests runs now to measure what the policy gives it), at least
        the policy's prior: what it measured earlier, at another load, does not say what it gets now."""
        if tpot >= BEST_EFFORT_TPOT_MS:
            return TierLoad(tpot, paced=False)
        st = self.stats.get(tpot)
        cost, gain = (st.cost, st.gain) if st is not None else (1.0, 1.0)
        if prior and self.spec_prior[1] > gain:
            cost, gain = self.spec_prior
        if cost <= 1.0 + 1e-6 and gain <= 1.0 + 1e-6:
            return TierLoad(pace)
        return TierLoad(pace, max(cost, 1.0), max(gain, 1.0))

    def _prune(self, view: SchedulerView) -> None:
        """Forget requests that are gone (the scheduler never hears of a finish)."""
        keep = view.live_rids
        if len(self.tier_of) > 2 * len(keep) + 64:
            self.tier_of = {k: v for k, v in self.tier_of.items() if k in keep}
            self.best_effort = {rid for rid in self.best_effort if rid in keep}
            self.acceptance.forget(keep)



__all__ = ["AdmissionCounts", "SloAdmission", "retry_after"]
