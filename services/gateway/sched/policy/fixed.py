"""Budget-blind baselines: fixed-length chains and SpecInfer's fixed expansion tree."""

from __future__ import annotations

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.policy.base import BatchView, Policy, Selected, Shape, Trees
from specserve.gateway.sched.policy.goodput import expected_tokens


class Chain(Policy):
    """Standard speculative decoding: K draft tokens in a chain for every request, every step."""

    uses_draft = True

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"chain length must be >= 1, got {k}")
        self.k = k
        self.name = f"chain:{k}"

    def shapes(self, batch: BatchView, model: PassCost) -> dict[str, Shape]:
        return {r.rid: Shape(min(self.k, r.remaining - 1), 1) for r in batch.requests}

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        return {rid: list(range(len(tree.tokens))) for rid, tree in candidates.items()}

    def spec_prior(self, acceptance: float) -> tuple[float, float]:
        """Its chain: K + 1 nodes, l(a, K) tokens."""
        return float(self.k + 1), expected_tokens(acceptance, self.k)

    def describe(self) -> dict:
        return {"name": self.name, "k": self.k}


class ExpansionTree(Policy):
    """SpecInfer's fixed tree: `widths[l]` children for every node at depth l (⟨1,1,3,1,1,1,1,1⟩
    gives 8 levels and 20 draft nodes).

    The draft proposes a beam of width max(widths); the tree is then cut from that beam by taking,
    under every selected node, its best `widths[l]` children present in the beam. A beam keeps the
    top-w paths of the whole layer, so a branch can lose children that a per-node top-k expansion
    would have kept: the tree can be smaller than the full expansion, never larger.
    """

    uses_draft = True

    def __init__(self, widths: list[int]):
        if not widths or any(k < 1 for k in widths):
            raise ValueError(f"tree widths must be positive integers, got {widths}")
        self.widths = widths
        self.name = "tree:" + ",".join(map(str, widths))

    def shapes(self, batch: BatchView, model: PassCost) -> dict[str, Shape]:
        depth, width = len(self.widths), max(self.widths)
        return {r.rid: Shape(min(depth, r.remaining - 1), width) for r in batch.requests}

    def spec_prior(self, acceptance: float) -> tuple[float, float]:
        """Its whole tree's nodes, and the tokens of a chain as deep (a lower bound: the other branches
        only add)."""
        nodes, layer = 1, 1
        for k in self.widths:
            layer *= k
            nodes += layer
        return float(nodes), expected_tokens(acceptance, len(self.widths))

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        out = {}
        for rid, tree in candidates.items():
            nodes, layer = [0], [0]
            for k in self.widths:
                nxt = []
                for v in layer:
                    kids = sorted(tree.children[v], key=lambda c: (-tree.path_prob[c], c))[:k]
                    nxt.extend(kids)
                nodes.extend(nxt)
                layer = nxt
            out[rid] = sorted(nodes)
        return out

    def describe(self) -> dict:
        return {"name": self.name, "widths": self.widths}
