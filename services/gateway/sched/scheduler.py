"""The scheduler: a snapshot of the gateway's state in, one IterationPlan out. No I/O, no clock.

`Scheduler.plan(view, step)` runs three stages:

1. **propose**: the FIFO default. Waiting requests in arrival order are placed by the router while
   some replica has room (KV blocks reserved for prompt + max_tokens + slack, `max_running`); the
   first that fits nowhere stops admission (later ones stay waiting, so a large request is not
   starved). Prompt chunks are cut per replica within `max_prefill_tokens`: requests already
   prefilling first, then the new ones, in order. A prompt is counted less what its replica's prefix
   cache is expected to hold (`WaitingView.cached`), and the router sends it where that is most when
   loads allow (`Router.route`).
2. **decide**: the policy's one hook, `Policy.decide(view)`, sees the proposal in the view and
   returns a `Decision`: admissions (with replica hints), deferrals and rejections with reasons,
   prompt chunks, speculation shapes, the draft's residency.
3. **enforce**: the hard limits, whatever the policy said. An admission that does not fit is
   deferred; chunks are cut to the prompt and the per-replica limit; shapes are cut to the tokens
   left, the draft's caps, and to d = 0 while the draft is down or offloaded (or is offloaded in this
   iteration). A residency change that is already in effect is dropped.
"""

from __future__ import annotations

import copy

from specserve.gateway.sched.admission.slo import AdmissionCounts, SloAdmission
from specserve.gateway.sched.plan import (
    NO_DRAFT,
    Admit,
    BatchView,
    Decision,
    IterationPlan,
    Proposal,
    Reject,
    Residency,
    SchedulerView,
    Shape,
    WaitingView,
)
from specserve.gateway.sched.policy.base import Policy
from specserve.gateway.sched.routing import Ledger, Router


class Scheduler:
    def __init__(self, policy: Policy, router: Router, *, sync_draft: bool = False,
                 admission: SloAdmission | None = None):
        self.policy = policy
        self.router = router
        self.sync_draft = sync_draft  # send d = 0 requests' new tokens to the draft every iteration
        self.admission = admission  # None: FIFO admission (below); else SLOs-Serve's planner proposes

    def plan(self, view: SchedulerView, step: int) -> IterationPlan:
        view.proposal = self.propose(view)
        return self.enforce(view, self.policy.decide(view), step)

    # ---- 1. the FIFO proposal ------------------------------------------------------------------
    def propose(self, view: SchedulerView) -> Proposal:
        if self.admission is not None:
            self.admission.last = AdmissionCounts()  # what this plan declined, counted once
        if not view.waiting and not any(view.stepping(p.replica) for p in view.prefilling):
            # the steady state of decoding: nothing to place
            return Proposal([], {}, {}, [0] * len(view.replicas))
        if self.admission is not None:
            return self._slo_proposal(view, self.admission)
        ledgers = _ledgers(view)
        router = copy.copy(self.router)  # a trial run: the real router moves on at enforcement
        admit: list[Admit] = []
        defer: dict[str, str] = {}
        max_running = view.limits.max_running
        for w in view.waiting:
            replica = router.route(ledgers, w.kv_blocks, max_running, w.cached)
            if replica is None:
                defer[w.rid] = _no_room(ledgers)
                break  # FIFO: nobody overtakes the head of the queue
            ledgers[replica].take(w.kv_blocks)
            router.picked(replica)
            admit.append(Admit(w.rid, replica))
        chunks, per_replica = self._fifo_chunks(view, admit)
        return Proposal(admit, defer, chunks, per_replica)

    def _slo_proposal(self, view: SchedulerView, admission: SloAdmission) -> Proposal:
        """The planner asks each request it is offered its router pick first (a trial run, as FIFO's),
        knowing what the speculation policy can give a tier that needs it (`Policy.spec_prior`, at the
        acceptance rate the admission measured)."""
        ledgers = _ledgers(view)
        router = copy.copy(self.router)
        first: dict[str, int] = {}
        for w in view.waiting[:admission.max_new]:  # the planner offers no more this iteration
            replica = router.route(ledgers, w.kv_blocks, view.limits.max_running, w.cached)
            if replica is not None:
                ledgers[replica].take(w.kv_blocks)
                router.picked(replica)
                first[w.rid] = replica
        admission.spec_prior = self.policy.spec_prior(admission.acceptance.rate)
        return admission.propose(view, {w.rid for w in view.waiting if w.best_effort}, first)

    def _fifo_chunks(self, view: SchedulerView, admitted: list[Admit]) -> tuple[dict[str, int], list[int]]:
        budget = [view.limits.max_prefill_tokens] * len(view.replicas)
        waiting = {w.rid: w for w in view.waiting}
        todo = [(p.rid, p.replica, p.prompt_tokens - p.prefilled) for p in view.prefilling]
        todo += [(a.rid, a.replica, waiting[a.rid].uncached(a.replica)) for a in admitted if a.replica is not None]
        chunks: dict[str, int] = {}
        for rid, replica, left in todo:
            take = min(left, budget[replica])
            if take > 0:
                chunks[rid] = take
                budget[replica] -= take
        return chunks, [view.limits.max_prefill_tokens - b for b in budget]

    # ---- 3. the hard limits --------------------------------------------------------------------
    def enforce(self, view: SchedulerView, decision: Decision, step: int) -> IterationPlan:
        waiting = {w.rid: w for w in view.waiting}
        asked = {a.rid for a in decision.admit}
        rejected = {rid: r for rid, r in view.proposal.reject.items() if rid in waiting and rid not in asked}
        rejected.update({rid: r for rid, r in decision.reject.items() if rid in waiting})
        deferred = {rid: why for rid, why in decision.defer.items() if rid in waiting and rid not in rejected}
        mine = {r.rid for r in view.decoding if view.stepping(r.replica)}
        preempt = [rid for rid in view.proposal.preempt if rid in mine]  # another replica's are its own
        admitted = self._admit(view, decision, waiting, rejected, deferred, preempt)
        proposal = view.proposal
        if decision.chunks is None and [(a.rid, a.replica) for a in admitted] == \
                [(a.rid, a.replica) for a in proposal.admit]:
            chunks, prefill = dict(proposal.chunks), list(proposal.prefill_tokens)
        elif decision.chunks is None:
            chunks, prefill = self._fifo_chunks(view, admitted)
        else:
            chunks, prefill = self._clip_chunks(view, admitted, decision.chunks)
        residency = decision.residency
        if not view.draft.up or (residency is Residency.OFFLOAD) == view.draft.offloaded:
            residency = Residency.KEEP
        # an offload happens before this iteration's draft call: nobody speculates in it
        draft_ok = view.draft.usable and self.policy.uses_draft and residency is not Residency.OFFLOAD
        shapes = self._shapes(view, decision.shapes, mine, draft_ok)
        sync = [r.rid for r in view.decoding if self.sync_draft and draft_ok and r.draft_lag > 0
                and r.rid in mine and shapes[r.rid].depth == 0]
        batches = view.batches(prefill)
        for rid in preempt:
            shapes.pop(rid)
        return IterationPlan(step, admitted, deferred, rejected, chunks, shapes, batches, residency,
                             sync, preempt)

    def _admit(self, view: SchedulerView, decision: Decision, waiting: dict[str, WaitingView],
               rejected: dict[str, Reject], deferred: dict[str, str], preempt: list[str]) -> list[Admit]:
        """The decision's admissions that fit each replica's KV blocks and running limit (the router picks
        another replica where the asked one is full); the rest are deferred (`deferred` is updated), all
        behind the first that does not fit under `strict_order`."""
        limits = view.limits
        ledgers = _ledgers(view) if decision.admit else []
        if ledgers and preempt:  # what the preempted give back is there to admit with
            going = set(preempt)
            for r in view.decoding:
                if r.rid in going:
                    ledgers[r.replica].reserved_blocks -= r.kv_blocks
                    ledgers[r.replica].running -= 1
        admitted: list[Admit] = []
        blocked: str | None = None
        for a in decision.admit:
            w = waiting.get(a.rid)
            if w is None or a.rid in rejected or any(x.rid == a.rid for x in admitted):
                continue
            if blocked is not None:
                deferred[a.rid] = f"waits behind {blocked}"
                continue
            replica = a.replica
            if replica is None or not 0 <= replica < len(ledgers) or not ledgers[replica].fits(w.kv_blocks,
                                                                                              limits.max_running):
                replica = self.router.route(ledgers, w.kv_blocks, limits.max_running, w.cached)
            if replica is None:
                deferred[a.rid] = _no_room(ledgers)
                if decision.strict_order:
                    blocked = a.rid
                continue
            ledgers[replica].take(w.kv_blocks)
            self.router.picked(replica)
            admitted.append(Admit(a.rid, replica))
            deferred.pop(a.rid, None)
        return admitted

    @staticmethod
    def _shapes(view: SchedulerView, wanted: dict[str, Shape], mine: set[str], draft_ok: bool) -> dict[str, Shape]:
        """Each of this loop's decoders' shape: the policy's, within the depth and width limits and its
        remaining tokens; no draft where drafting is off this iteration or the policy gave none."""
        limits = view.limits
        shapes: dict[str, Shape] = {}
        for r in view.decoding:
            if r.rid not in mine:
                continue
            s = wanted.get(r.rid)
            if s is None or not draft_ok or s.depth <= 0:
                shapes[r.rid] = NO_DRAFT
                continue
            cap = min(r.remaining - 1, limits.max_depth)
            if s.depth > cap or not 1 <= s.width <= limits.max_width:  # only then a new Shape
                s = Shape(max(0, min(s.depth, cap)), max(1, min(s.width, limits.max_width)))
            shapes[r.rid] = s
        return shapes

    def _clip_chunks(self, view: SchedulerView, admitted: list[Admit],
                     wanted: dict[str, int]) -> tuple[dict[str, int], list[int]]:
        """The policy's chunks, cut to each prompt's rest and each replica's `max_prefill_tokens`."""
        left = {p.rid: (p.replica, p.prompt_tokens - p.prefilled) for p in view.prefilling}
        waiting = {w.rid: w for w in view.waiting}
        left.update({a.rid: (a.replica, waiting[a.rid].uncached(a.replica)) for a in admitted if a.replica is not None})
        budget = [view.limits.max_prefill_tokens] * len(view.replicas)
        chunks: dict[str, int] = {}
        for rid, n in wanted.items():
            if rid not in left:
                continue
            replica, rest = left[rid]
            take = min(n, rest, budget[replica])
            if take > 0:
                chunks[rid] = take
                budget[replica] -= take
        return chunks, [view.limits.max_prefill_tokens - b for b in budget]


def _ledgers(view: SchedulerView) -> list[Ledger]:
    return [Ledger(r.up, r.total_blocks, r.reserved_blocks, r.running) for r in view.replicas]


def _no_room(ledgers: list[Ledger]) -> str:
    if not any(led.up for led in ledgers):
        return "no target replica is up"
    return "no replica has room for it now (KV blocks or max_running)"


__all__ = ["BatchView", "Scheduler"]
