"""The acceptance model: the candidate tree a simulated draft proposes, and what the target accepts.

The draft is modelled per expanded node x at depth k - 1 by a distribution over the ranks of its
candidate children: the top candidate has probability p0 ~ Beta(alpha_k * kappa, (1 - alpha_k) * kappa),
and rank r >= 1 has (1 - p0) * (1 - beta) * beta ** (r - 1). If x lies on the true path, the true
next token sits at a rank drawn from that same distribution (so it may be missing from the w
candidates). The beam keeps, layer by layer, the w candidates of highest path probability among all
children of the previous layer, as the real draft does (services/draft/beam.py).

Consequences, which tests/unit/test_simulate.py checks by sampling:
- a chain (w = 1) accepts depth k, given depth k - 1, with probability exactly alpha_k;
- the reported path probabilities are calibrated: a node is on the true path with probability
  equal to its path probability, so the mean accepted length of any tree (or of any subtree the
  gateway selects from it) is the sum of its nodes' path probabilities;
- kappa sets how much p0 varies from node to node, that is how informative the probabilities
  are for choosing which branches to verify (large kappa: every node alike).

The target side (`accept_choices`) follows the true tokens from the root: the longest root path
that matches them, then the true next token as the bonus.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specserve.shared.spec.penalties import TokenHistory
from specserve.shared.spec.sampling import SamplingParams
from specserve.shared.spec.token_tree import children_by_token
from specserve.shared.spec.tree_acceptance import Acceptance, walk


@dataclass(frozen=True, slots=True)
class AcceptanceModel:
    depth_accept: tuple[float, ...]  # alpha_k for k = 1, 2, ...: chain acceptance at depth k; the last repeats
    rank_tail: float = 0.5  # beta: P(true rank > r | true rank >= r) for r >= 1
    concentration: float = 4.0  # kappa of the Beta distribution of the top candidate's probability

    def __post_init__(self) -> None:
        if not self.depth_accept or not all(0 < a < 1 for a in self.depth_accept):
            raise ValueError(f"depth_accept needs values in (0, 1), got {list(self.depth_accept)}")
        if not 0 <= self.rank_tail < 1:
            raise ValueError(f"rank_tail must be in [0, 1), got {self.rank_tail}")
        if not self.concentration > 0:
            raise ValueError(f"concentration must be > 0, got {self.concentration}")

    def alpha(self, depth: int) -> float:
        return self.depth_accept[min(depth, len(self.depth_accept)) - 1]

    def rank_probs(self, p0: float, width: int) -> list[float]:
        """Probabilities of ranks 0 .. width-1 of a node whose top candidate has probability p0."""
        beta = self.rank_tail
        return [p0] + [(1 - p0) * (1 - beta) * beta ** (r - 1) for r in range(1, width)]

    def true_rank(self, rng: random.Random, p0: float) -> int:
        if rng.random() < p0:
            return 0
        rank = 1
        while rng.random() < self.rank_tail:
            rank += 1
        return rank

    def propose(self, rng: random.Random, truth: Sequence[int], wrong: Callable[[int, int, int], list[int]],
                depth: int, width: int, root: int) -> tuple[list[int], list[int], list[float]]:
        """A beam tree of `depth` layers of `width` nodes under `root`: (tokens, parents, path probs).

        truth[k - 1]: the true token at depth k; wrong(k, node, count): `count` distinct tokens other
        than truth[k - 1] for the children of tree node `node` at depth k."""
        tokens, parents, probs = [root], [-1], [1.0]
        layer, true_node = [0], 0  # true_node: the tree node on the true path in the newest layer, or -1
        for k in range(1, depth + 1):
            alpha = self.alpha(k)
            a, b = alpha * self.concentration, (1 - alpha) * self.concentration
            candidates: list[tuple[float, int, int, int]] = []  # (-path prob, parent order, rank, parent node)
            true_rank: dict[int, int] = {}
            for order, node in enumerate(layer):
                p0 = rng.betavariate(a, b)
                if node == true_node:
                    true_rank[node] = self.true_rank(rng, p0)
                for rank, p in enumerate(self.rank_probs(p0, width)):
                    candidates.append((-probs[node] * p, order, rank, node))
            chosen = heapq.nsmallest(width, candidates)
            new_layer, new_true = [], -1
            by_parent: dict[int, list[tuple[float, int]]] = {}
            for neg_p, _, rank, node in chosen:
                by_parent.setdefault(node, []).append((-neg_p, rank))
            for node, children in by_parent.items():
                is_true = true_rank.get(node, -1)
                others = iter(wrong(k, node, len(children)))
                for p, rank in children:
                    new_layer.append(len(tokens))
                    if rank == is_true:
                        new_true = len(tokens)
                        tokens.append(truth[k - 1])
                    else:
                        tokens.append(next(others))
                    parents.append(node)
                    probs.append(p)
            layer, true_node = new_layer, new_true
        return tokens, parents, probs


def accept_choices(tokens: Sequence[int], parents: Sequence[int], choices: torch.Tensor,
                   params: SamplingParams, generator: torch.Generator | None = None,
                   history: TokenHistory | None = None) -> Acceptance:
    """The simulated target's acceptance (the signature of shared.tree_acceptance.accept_tree):
    choices [n_nodes] holds the true next token after every node; from the root, follow the
    child that matches it; at the first miss, emit it. Sampling parameters and penalties do not change the truth."""
    truth: list[int] = choices.tolist()
    return walk(children_by_token(tokens, parents), truth.__getitem__)
