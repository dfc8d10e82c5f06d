"""Greedy node selection from candidate trees with frontier heaps (AdaServe §3.3, errata applied).

A selection starts at the root; a request's frontier holds the children of selected nodes, keyed
by (f̂ desc, depth asc, node id asc), so picks stay parent-before-child even on ties. The global
heap adds the request's batch position to the key so ties between requests break by admission
order.
"""

from __future__ import annotations

import heapq

from specserve.gateway.sched.policy.base import CandidateTree


class Selection:
    """Selected nodes and the running expected-accept sum n_acc of every request."""

    def __init__(self, candidates: dict[str, CandidateTree]):
        self.trees = candidates
        self.order = {rid: i for i, rid in enumerate(candidates)}
        self.nodes: dict[str, list[int]] = {rid: [0] for rid in candidates}
        self.n_acc: dict[str, float] = {rid: 1.0 for rid in candidates}  # the root is always accepted
        self.frontier: dict[str, list[tuple]] = {rid: [] for rid in candidates}
        for rid in candidates:
            self._push_children(rid, 0)

    def _key(self, rid: str, v: int) -> tuple:
        tree = self.trees[rid]
        return (-tree.path_prob[v], tree.depths[v], v)

    def _push_children(self, rid: str, v: int) -> None:
        for c in self.trees[rid].children[v]:
            heapq.heappush(self.frontier[rid], self._key(rid, c))

    def take(self, rid: str) -> bool:
        """Add the best frontier node of one request; False if its frontier is empty."""
        heap = self.frontier[rid]
        if not heap:
            return False
        _, _, v = heapq.heappop(heap)
        self._add(rid, v)
        return True

    def _add(self, rid: str, v: int) -> None:
        self.nodes[rid].append(v)
        self.n_acc[rid] += self.trees[rid].path_prob[v]
        self._push_children(rid, v)

    def take_global(self, budget: int, rids: list[str] | None = None) -> int:
        """Spend up to `budget` nodes on the best frontier nodes across requests; returns the spent count."""
        heap = [(k[0], k[1], self.order[rid], k[2], rid) for rid in (rids or self.trees) for k in self.frontier[rid]]
        heapq.heapify(heap)
        for rid in rids or self.trees:
            self.frontier[rid] = []  # the global heap owns them now
        spent = 0
        while spent < budget and heap:
            _, _, _, v, rid = heapq.heappop(heap)
            self.nodes[rid].append(v)
            self.n_acc[rid] += self.trees[rid].path_prob[v]
            spent += 1
            for c in self.trees[rid].children[v]:
                k = self._key(rid, c)
                heapq.heappush(heap, (k[0], k[1], self.order[rid], k[2], rid))
        return spent

    def result(self) -> dict[str, list[int]]:
        return {rid: sorted(nodes) for rid, nodes in self.nodes.items()}
