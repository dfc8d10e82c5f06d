"""Lossless token-tree acceptance: every step yields accepted draft tokens plus one target token.

Greedy: from the root, follow the target's argmax while it matches a child; at the first miss,
emit the target's own token. Sampling: at each node draw from the target's distribution; if the
draw is a child, move there, else emit it and stop. Either way each emitted token is exactly what
the target alone would have produced (the draws are the target's own), so output is unchanged
in distribution, and token for token under greedy or a fixed seed.

With penalties (repetition, presence, frequency, min_tokens) the logits are first penalized node by
node along each node's own path (shared/spec/penalties.py), from the request's `TokenHistory`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specserve.shared.spec.penalties import TokenHistory, penalize
from specserve.shared.spec.sampling import SamplingParams, greedy_tokens, probabilities, sample
from specserve.shared.spec.token_tree import children_by_token


@dataclass(slots=True)
class Acceptance:
    path: list[int]  # accepted node indices, root first (the KV rows to commit)
    tokens: list[int]  # emitted tokens: accepted draft tokens, then the target's token

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.path) - 1


def accept_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    history: TokenHistory | None = None,
    greedy: Sequence[int] | None = None,
) -> Acceptance:
    """logits [n_nodes, V]: the target's next-token logits at every node of the tree; history: the
    request's tokens so far, which the penalties read (required when `params` asks for any); greedy: the
    logits' argmax at every node where the caller took them already (`greedy_rows` over a whole call),
    used when no penalty changes the logits."""
    if history is not None and (params.penalized or params.holds_stops):
        logits = penalize(logits, tokens, parents, params, history)
        greedy = None  # taken from the logits before the penalties
    if params.is_greedy:
        choices = greedy if greedy is not None else greedy_tokens(logits)
        if len(tokens) == 1:  # a plain decode: the target's own token
            return Acceptance([0], [choices[0]])

        def draw(node: int) -> int:
            return choices[node]
    else:
        probs = probabilities(logits, params)

        def draw(node: int) -> int:
            return sample(probs[node], generator)

    return walk(children_by_token(tokens, parents), draw)


def walk(children: Sequence[dict[int, int]], draw: Callable[[int], int]) -> Acceptance:
    """From the root, emit the target's token at each node (`draw`) and move to the child holding it;
    stop after the first token no child holds."""
    path, emitted, node = [0], [], 0
    while True:
        token = draw(node)
        emitted.append(token)
        child = children[node].get(token)
        if child is None:
            return Acceptance(path, emitted)
        path.append(child)
        node = child
