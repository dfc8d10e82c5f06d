"""AdaServe (SLO-customized speculative decoding) and its two ablations from the paper.

- `adaserve`: d and w from eq. 8-9; then the SLO phase: requests in order of A(r) descending each
  take their best frontier nodes until n_acc reaches A_cap = min(A(r), d + 1), n_max nodes were
  added, the budget runs out or the frontier empties; then the throughput phase spends what is
  left of B on the best frontier nodes of the whole batch.
- `global-greedy`: the throughput phase alone (no SLO phase).
- `equal-greedy`: B split equally between requests, greedy within each.

The budget B counts roots (AdaServe's convention) and is reduced by co-scheduled prefill tokens.
"""

from __future__ import annotations

import math

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.plan import NO_DRAFT
from specserve.gateway.sched.policy.base import BatchView, Policy, Selected, Shape, Trees
from specserve.gateway.sched.policy.selection import Selection


class _BudgetedTrees(Policy):
    uses_draft = True

    def __init__(self, max_depth: int = 8, max_width: int = 4, max_added: int = 16):
        self.max_depth = max_depth  # D_max
        self.max_width = max_width  # W_max
        self.max_added = max_added  # n_max: most nodes the SLO phase adds to one request

    def shapes(self, batch: BatchView, model: PassCost) -> dict[str, Shape]:
        n = len(batch.requests)
        budget = batch.tree_budget(model)
        if n == 0 or budget <= n:  # the roots use the whole budget: skip drafting (digest, pitfalls)
            return {r.rid: NO_DRAFT for r in batch.requests}
        d = max(1, min(self.max_depth, math.ceil(budget / n)))  # eq. 8
        w = max(1, min(self.max_width, budget // n))  # eq. 9
        return {r.rid: Shape(min(d, r.remaining - 1), w) for r in batch.requests}

    def describe(self) -> dict:
        return {"name": self.name, "max_depth": self.max_depth, "max_width": self.max_width,
                "max_added": self.max_added}


class AdaServe(_BudgetedTrees):
    name = "adaserve"

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        sel = Selection(candidates)
        left = batch.tree_budget(model) - len(candidates)  # roots are charged first
        views = sorted((r for r in batch.requests if r.rid in candidates),
                       key=lambda r: r.required(model.t_spec_ms), reverse=True)
        for r in views:  # SLO phase, most-behind first
            tree = candidates[r.rid]
            target = min(r.required(model.t_spec_ms), max(tree.depths) + 1)  # A_cap
            added = 0
            while sel.n_acc[r.rid] < target and added < self.max_added and left > 0 and sel.take(r.rid):
                added += 1
                left -= 1
        sel.take_global(left)  # throughput phase
        return sel.result()


class GlobalGreedy(_BudgetedTrees):
    name = "global-greedy"

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        sel = Selection(candidates)
        sel.take_global(batch.tree_budget(model) - len(candidates))
        return sel.result()


class EqualGreedy(_BudgetedTrees):
    name = "equal-greedy"

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        sel = Selection(candidates)
        n = len(candidates)
        share = (batch.tree_budget(model) - n) // n if n else 0
        for rid in candidates:
            for _ in range(share):
                if not sel.take(rid):
                    break
        return sel.result()
