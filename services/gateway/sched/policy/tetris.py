"""TETRIS: batch-wide selection of the most promising chain draft tokens under a capacity C.

Every request drafts a chain of K = k + e tokens (beam width 1); the target verifies at most C
draft tokens in the whole batch, the C with the highest cumulative draft probability, each row a
prefix of its chain (the TETRIS digest, corrected Algorithm 1).

C counts draft tokens only, not the N roots: AdaServe's budget B counts roots, so B = C + N. Here
C = min(N k, B - N), B the replica's budget after co-scheduled prefill tokens: the paper verifies
as many tokens as standard SD with window k, and the budget caps it.
"""

from __future__ import annotations

import heapq

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.policy.base import BatchView, CandidateTree, Policy, Selected, Shape, Trees


def tetris_select(cumulative: list[list[float]], capacity: int) -> list[int]:
    """Corrected Algorithm 1. `cumulative[i][j-1]` is P_{i,j}, the product of the surrogate acceptance
    probabilities of draft tokens 1..j of row i (len = K_i). Returns Z: row i verifies its first Z[i]
    draft tokens. Ties break by (P desc, j asc, i asc); stops at C tokens or when every row is exhausted."""
    z = [0] * len(cumulative)
    heap = [(-row[0], 1, i) for i, row in enumerate(cumulative) if row]  # seeded with B_{i,1}, not B_{i,0}
    heapq.heapify(heap)
    taken = 0
    while taken < capacity and heap:
        _, j, i = heapq.heappop(heap)
        z[i] = j
        taken += 1
        if j + 1 <= len(cumulative[i]):
            heapq.heappush(heap, (-cumulative[i][j], j + 1, i))
    return z


class Tetris(Policy):
    uses_draft = True

    def __init__(self, k: int = 3, extra: int = 1):
        if k < 1 or extra < 0:
            raise ValueError(f"tetris needs k >= 1 and e >= 0, got k={k}, e={extra}")
        self.k, self.extra = k, extra
        self.name = f"tetris:{k},{extra}"

    def shapes(self, batch: BatchView, model: PassCost) -> dict[str, Shape]:
        return {r.rid: Shape(min(self.k + self.extra, r.remaining - 1), 1) for r in batch.requests}

    def capacity(self, batch: BatchView, model: PassCost, n: int) -> int:
        """C: draft tokens the target verifies in this replica's pass (roots excluded)."""
        return max(0, min(n * self.k, batch.tree_budget(model) - n))

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        rids = list(candidates)
        rows = [_chain_probs(candidates[rid]) for rid in rids]
        z = tetris_select(rows, self.capacity(batch, model, len(rids)))
        return {rid: list(range(z[i] + 1)) for i, rid in enumerate(rids)}

    def describe(self) -> dict:
        return {"name": self.name, "k": self.k, "extra": self.extra}


def _chain_probs(tree: CandidateTree) -> list[float]:
    """P_{i,1..K} of a chain candidate: node j is the j-th draft token (the draft's cumulative f̂).
    A tree that is not a chain (never with width 1) is cut at its first branching."""
    out: list[float] = []
    v = 0
    while len(tree.children[v]) >= 1:
        v = min(tree.children[v])
        if v != len(out) + 1:
            break
        out.append(tree.path_prob[v])
    return out


__all__ = ["Tetris", "tetris_select"]
