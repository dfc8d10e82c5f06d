"""`slo-goodput`: AdaServe's SLO-customized selection under a budget from the goodput model.

Built from the seed papers' parts:

- the budget: TurboSpec's goodput model (goodput.py) picks the chain length k* that maximises
  predicted goodput at the running batch (not B profiled at batch 8); the replica's budget is then
  B* = n + sum_i min(k*, remaining_i - 1), tokens of the target pass, roots included;
- the off switch: k* = 0 means no draft call at all (and the draft-prefill skip and probing of
  TurboSpec's controller);
- the drafts: chains of k* + e tokens (e extra tokens as TETRIS drafts when n > 1, so the budget
  can move between requests);
- the selection: AdaServe's SLO phase (most-behind first, up to A_cap = min(A(r), depth + 1),
  n_max nodes each) that skips requests that can no longer meet their TPOT SLO even if every
  remaining step accepted its whole chain (adaserve digest pitfalls: a hopeless request must not
  monopolise the budget), then the throughput phase over the rest of B*.
"""

from __future__ import annotations

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import NO_DRAFT, SchedulerView
from specserve.gateway.sched.policy.base import BatchView, Decision, Policy, RequestView, Selected, Shape, Trees
from specserve.gateway.sched.policy.goodput import expected_tokens
from specserve.gateway.sched.policy.selection import Selection
from specserve.gateway.sched.policy.turbospec import GoodputControl


def hopeless(r: RequestView, t_step_ms: float, best_tokens_per_step: float) -> bool:
    """True when the request misses its TPOT SLO even if all its remaining tokens come at the best
    expected rate: the time left, tpot * (decoded + remaining) - elapsed, is shorter than the time
    the remaining tokens need at `best_tokens_per_step` tokens per `t_step_ms`. The most optimistic
    case (the whole `remaining`), so a request that may still make it is never given up."""
    left_ms = r.tpot_ms * (r.decoded + r.remaining) - r.decode_elapsed_ms
    return left_ms < r.remaining * t_step_ms / max(best_tokens_per_step, 1.0)


class SloGoodput(Policy):
    name = "slo-goodput"
    uses_draft = True

    def __init__(self, max_depth: int = 8, extra: int = 1, max_added: int = 16, margin: float = 0.03,
                 probe_every: int = 50):
        self.control = GoodputControl(max_k=max_depth, margin=margin, probe_every=probe_every)
        self.max_depth = max_depth
        self.extra = extra  # e: draft tokens beyond k* per request, for the SLO phase to move budget
        self.max_added = max_added  # n_max
        self.budget: dict[int, int] = {}  # replica -> B* of this iteration

    def decide(self, view: SchedulerView) -> Decision:
        self.control.admit(view)
        for rep in view.replicas:  # the replicas this plan shapes start afresh (the others are mid-iteration)
            if view.stepping(rep.index):
                self.budget.pop(rep.index, None)
        return super().decide(view)

    def shapes(self, batch: BatchView, model: PassCost) -> dict[str, Shape]:
        k, spec = self.control.choose(batch, model)
        probe = self.control.probe(batch, spec, k)
        if self.control.pause(batch, k):
            spec, k = [], 0
        chosen = {r.rid for r in spec}
        n = len(batch.requests)
        depth = min(self.max_depth, k + (self.extra if n > 1 else 0)) if k > 0 else 0
        shapes = {r.rid: Shape(min(depth, r.remaining - 1), 1) if r.rid in chosen else NO_DRAFT
                  for r in batch.requests}
        self.budget[batch.replica] = n + sum(min(k, r.remaining - 1) for r in spec if k > 0)
        if probe is not None:
            rid, extra = probe
            shapes[rid] = Shape(extra, 1)
            self.budget[batch.replica] += extra
        return shapes

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        sel = Selection(candidates)
        left = self.budget.get(batch.replica, len(candidates)) - len(candidates)  # roots are charged first
        views = sorted((r for r in batch.requests if r.rid in candidates),
                       key=lambda r: r.required(model.t_spec_ms), reverse=True)
        for r in views:  # SLO phase, most-behind first, the hopeless left out
            tree = candidates[r.rid]
            depth = max(tree.depths)
            if depth == 0 or left <= 0:
                continue
            a = self.control.acceptance.rate_of(r.rid)
            if hopeless(r, model.t_spec_ms, expected_tokens(a, depth)):
                continue
            target = min(r.required(model.t_spec_ms), depth + 1)  # A_cap
            added = 0
            while sel.n_acc[r.rid] < target and added < self.max_added and left > 0 and sel.take(r.rid):
                added += 1
                left -= 1
        sel.take_global(max(0, left))  # throughput phase
        selected = sel.result()
        self.control.selected(candidates, selected)
        return selected

    def observe(self, record: IterationRecord) -> None:
        self.control.observe(record)

    def describe(self) -> dict:
        return {"name": self.name, "max_depth": self.max_depth, "extra": self.extra, "max_added": self.max_added,
                "margin": self.control.margin, "probe_every": self.control.probe_every}


__all__ = ["SloGoodput", "hopeless"]
