"""Side branches beside `joint`'s chains: trees where the draft offers several continuations and the
cost model says they pay.

`joint` chooses who drafts and how deep as chains (joint.py). A draft that offers alternatives (the
n-gram draft's several continuations, a model draft's beams, the simulated draft's trees) can give
each chain siblings: a token the chain's node misses may be one of its siblings, and the target
verifies them in the same pass. `Branches` prices that, per replica pass:

- `widen`: ask the draft for trees of width `width` instead of chains when the draft's extra time
  for the width (the cost model's draft line) is worth less than the side tokens the last tree passes
  verified, at the pass's predicted goodput (tokens per ms). A draft whose width costs nothing (the
  n-gram draft) is always asked; after `probe_every` drafting passes on chains one pass asks again,
  so the side gain stays measured.
- `grow`: which nodes of the candidate trees the target verifies. Each request's chain (the most
  probable child at every level) is verified whole, as `joint` priced it. Side nodes are then added
  across the pass in order of their estimated acceptance c * f̂(v) (f̂: the draft's path probability;
  c: the calibration below), each while its expected tokens per ms of target time beat the pass's
  predicted goodput, the pass stays within its tree budget, and its predicted time T stays within
  what every request that keeps its pace now allows (pace times its expected chain tokens: a side
  node never makes a request late that its chain, or its root, keeps on time).
- `observe`: the calibration c, accepted draft tokens over the summed f̂ of the verified draft nodes
  (decayed; f̂ is a draft's belief, c what the target made of it). `grow` keeps the side gain, the
  expected side tokens a drafting request got per tree pass (decayed).

Pure arithmetic on the views and the IterationRecord: no I/O.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import BatchView, RequestView
from specserve.gateway.sched.policy.base import CandidateTree, Selected, Trees
from specserve.gateway.sched.policy.goodput import expected_tokens


def spine(tree: CandidateTree) -> list[int]:
    """The tree's chain: from the root, the most probable child at every level (the lowest index on a tie)."""
    nodes, v = [0], 0
    while tree.children[v]:
        v = max(tree.children[v], key=lambda c: (tree.path_prob[c], -c))
        nodes.append(v)
    return nodes


@dataclass(slots=True)
class Branches:
    width: int = 4  # the width asked of the draft for trees
    probe_every: int = 50  # drafting passes on chains before one asks for trees again
    decay: float = 0.98  # weight kept by the calibration's counts at every pass that verified draft nodes
    prior_weight: float = 4.0  # pseudo-observations of c = 1 (f̂ taken at its word until measured)
    gain_decay: float = 0.9  # weight kept by the side gain at every tree pass
    gain: float = 0.25  # side tokens per drafting request per tree pass (optimistic until measured)
    gain_floor: float = 0.02  # the least side gain a tree is priced with (a free width is always asked)
    accepted: float = 0.0  # decayed accepted draft tokens of tree passes
    believed: float = 0.0  # decayed sum of f̂ over the verified draft nodes of those passes
    chains_run: int = 0  # drafting passes on chains since trees were last asked
    pending: dict[str, float] = field(default_factory=dict)  # rid -> sum of f̂ it verified this pass
    side: dict[str, int] = field(default_factory=dict)  # rid -> side nodes it verifies this pass

    @property
    def calibration(self) -> float:
        return (self.accepted + self.prior_weight) / (self.believed + self.prior_weight)

    def widen(self, cost: PassCost, spec: list[RequestView], depth: int, tokens: float, step_ms: float) -> bool:
        """Whether `spec`, drafting `depth`-deep chains in a pass predicted at `tokens` expected tokens and
        `step_ms`, should draft trees of `width` instead."""
        if self.width <= 1 or depth <= 0 or not spec:
            return False
        lag = sum(r.draft_lag for r in spec)
        extra = cost.draft_ms(depth, len(spec), self.width, lag) - cost.draft_ms(depth, len(spec), 1, lag)
        worth = len(spec) * max(self.gain, self.gain_floor) * step_ms / max(tokens, 1e-9)  # ms, at the pass's goodput
        if extra <= worth:
            return True
        self.chains_run += 1
        if self.chains_run >= self.probe_every:
            self.chains_run = 0
            return True
        return False

    def grow(self, batch: BatchView, candidates: Trees, cost: PassCost, rates: dict[str, float],
             paces: dict[str, float]) -> Selected:
        """The nodes to verify: every chain whole, then the side nodes that pay (module docstring).
        rates: each request's chain acceptance (`Acceptance.rates`); paces: each one's `pace_ms()`."""
        chains = {rid: spine(tree) for rid, tree in candidates.items()}
        selected = {rid: list(nodes) for rid, nodes in chains.items()}
        offered = [rid for rid, nodes in chains.items() if len(nodes) < len(candidates[rid].tokens)]
        if offered:
            self._grow(batch, candidates, cost, rates, paces, chains, selected)
            spec = sum(1 for nodes in chains.values() if len(nodes) > 1)
            side = sum(candidates[rid].path_prob[v] for rid in offered for v in selected[rid][len(chains[rid]):])
            self.gain = self.gain_decay * self.gain + (1.0 - self.gain_decay) * self.calibration * side / max(spec, 1)
            self.chains_run = 0
        result = {rid: sorted(nodes) for rid, nodes in selected.items()}
        self.side.update({rid: len(nodes) - len(chains[rid]) for rid, nodes in selected.items()})
        self.pending.update({rid: sum(candidates[rid].path_prob[v] for v in nodes if v)
                             for rid, nodes in result.items()})
        return result

    def _grow(self, batch: BatchView, candidates: Trees, cost: PassCost, rates: dict[str, float],
              paces: dict[str, float], chains: dict[str, list[int]], selected: Selected) -> None:
        """Add side nodes to `selected` in order of c * f̂ while each pays (module docstring)."""
        c = self.calibration
        depth = {rid: len(nodes) - 1 for rid, nodes in chains.items()}
        spec = {rid for rid, d in depth.items() if d > 0}
        mine = {r.rid: expected_tokens(rates.get(r.rid, 0.0), depth.get(r.rid, 0)) for r in batch.requests}
        tokens = sum(mine.values())
        n_tokens = batch.prefill_tokens + len(batch.requests) + sum(depth.values())
        kv = batch.kv_blocks
        lag = sum(r.draft_lag for r in batch.requests if r.rid in spec)
        step_ms = cost.iteration_ms(n_tokens, max(depth.values(), default=0), len(spec), self.width, lag, kv)
        # a request keeps its pace when its expected chain tokens cover the step (pace * tokens >= T)
        limit = min((paces[rid] * e for rid, e in mine.items() if rid in paces and paces[rid] * e >= step_ms),
                    default=float("inf"))
        budget = batch.tree_budget(cost) + batch.prefill_tokens
        order = {rid: i for i, rid in enumerate(candidates)}
        taken = {rid: set(nodes) for rid, nodes in chains.items()}
        heap = [(-candidates[rid].path_prob[ch], order[rid], ch, rid) for rid, nodes in chains.items()
                for v in nodes for ch in candidates[rid].children[v] if ch not in taken[rid]]
        heapq.heapify(heap)
        while heap and n_tokens < budget:
            neg_p, i, v, rid = heapq.heappop(heap)
            gain = -neg_p * c
            dt = cost.target_ms(n_tokens + 1, kv) - cost.target_ms(n_tokens, kv)
            if gain * step_ms < tokens * dt or step_ms + dt > limit:
                break  # the best side node left does not pay; the others are less probable
            selected[rid].append(v)
            n_tokens, tokens, step_ms = n_tokens + 1, tokens + gain, step_ms + dt
            for ch in candidates[rid].children[v]:
                heapq.heappush(heap, (-candidates[rid].path_prob[ch], i, ch, rid))

    def observe(self, record: IterationRecord) -> None:
        """Calibrate f̂ by what the target accepted of the nodes `grow` chose."""
        accepted = believed = 0.0
        for s in record.requests:
            self.side.pop(s.rid, None)
            mine = self.pending.pop(s.rid, 0.0)
            if mine > 0 and s.error is None and s.verified > 0:
                accepted, believed = accepted + s.accepted, believed + mine
        if believed > 0:
            self.accepted = self.accepted * self.decay + accepted
            self.believed = self.believed * self.decay + believed


__all__ = ["Branches", "spine"]
