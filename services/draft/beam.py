"""Batched beam speculation (AdaServe's Spec()): d steps of width w from every request's root.

Step 1 expands each root, from the root's logits that the catch-up pass already returned, into its
top-w children. Each later step runs the w beam tokens of every request in one batched pass
(DraftNodes: tree attention over the committed context plus each node's ancestors) and keeps the
top-w of the w x V extensions by cumulative log probability. The nodes of the last layer are never
run through the model. The pending beam nodes are discarded at the end, so the draft's KV holds
exactly the committed tokens between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.shared.runtime.batch import DraftNodes
from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.spec.sampling import greedy_tokens

if TYPE_CHECKING:
    from specserve.draft.static_step import StaticBeamStep


@dataclass(slots=True)
class BeamRequest:
    rid: str
    root: int  # the newest committed token (its KV is in the cache; root_logits follow it)
    root_logits: torch.Tensor  # [V] float32 next-token logits after the root
    depth: int  # >= 1
    width: int  # >= 1


@dataclass(slots=True)
class BeamTree:
    tokens: list[int]  # root first, then layer by layer
    parents: list[int]  # -1 for the root
    logp: list[float]  # log of the path probability; 0 for the root
    layer: list[int] = field(default_factory=list)  # node indices of the newest layer


def _select(tree: BeamTree, layer_logp: torch.Tensor, logprobs: torch.Tensor, width: int) -> None:
    """Append the top-`width` extensions of the current layer (logprobs [len(layer), V])."""
    vocab = logprobs.shape[-1]
    scores = (layer_logp.to(logprobs.device)[:, None] + logprobs).flatten()
    if width == 1:  # a chain: the argmax (greedy_tokens, cheaper than torch.topk on the CPU)
        index = greedy_tokens(scores[None])[0]
        best = [(float(scores[index]), index)]
    else:
        top = torch.topk(scores, min(width, scores.numel()))
        best = list(zip(top.values.tolist(), top.indices.tolist()))
    new_layer = []
    for score, index in best:
        new_layer.append(len(tree.tokens))
        tree.parents.append(tree.layer[index // vocab])
        tree.tokens.append(index % vocab)
        tree.logp.append(score)
    tree.layer = new_layer


def _extend_chains(trees: list[BeamTree], logprobs: torch.Tensor) -> None:
    """`_select` at width 1 for several chains at once (logprobs [len(trees), V]: each chain's row after its
    newest node): the same float32 sums and argmax, read back once for all of them (on a GPU, two
    synchronizations a step instead of two a request)."""
    base = torch.tensor([tree.logp[tree.layer[0]] for tree in trees]).to(logprobs.device)
    scores = base[:, None] + logprobs
    index = greedy_tokens(scores)
    values = scores.gather(1, torch.tensor(index, device=scores.device)[:, None]).flatten().tolist()
    for tree, i, score in zip(trees, index, values, strict=True):
        tree.parents.append(tree.layer[0])
        tree.layer = [len(tree.tokens)]
        tree.tokens.append(i)
        tree.logp.append(score)


def beam_search(runner: ModelRunner, requests: list[BeamRequest],
                static_step: StaticBeamStep | None = None) -> tuple[dict[str, BeamTree], int]:
    """Returns the tree per request id and the number of model passes run.

    static_step: run the passes at bucketed static shapes (CUDA graphs) when their shape allows.
    """
    trees = {r.rid: BeamTree([r.root], [-1], [0.0], [0]) for r in requests}
    if not requests:
        return trees, 0
    root_logprobs = torch.log_softmax(torch.stack([r.root_logits for r in requests]).float(), dim=-1)
    chains = all(r.width == 1 for r in requests)  # then each step's rows are one a request, in order
    if chains:
        _extend_chains([trees[r.rid] for r in requests], root_logprobs)
    else:
        for r, logprobs in zip(requests, root_logprobs):
            _select(trees[r.rid], torch.zeros(1), logprobs[None], r.width)
    forwards = 0
    try:
        for step in range(2, max(r.depth for r in requests) + 1):
            active = [r for r in requests if r.depth >= step]
            entries = []
            for r in active:
                tree = trees[r.rid]
                # Pending-forest index of tree node i is i - 1 (the root is committed, not pending).
                entries.append(DraftNodes(r.rid, [tree.tokens[i] for i in tree.layer],
                                          [tree.parents[i] - 1 for i in tree.layer]))
            if static_step is not None and static_step.applies(entries):
                logits = static_step.forward(entries)
            else:
                logits = runner.forward(entries)
            forwards += 1
            rows = torch.log_softmax(torch.cat(logits).float(), dim=-1)
            if chains:
                _extend_chains([trees[r.rid] for r in active], rows)
                continue
            logprobs = rows.split([len(x) for x in logits])
            for r, lp in zip(active, logprobs):
                tree = trees[r.rid]
                _select(tree, torch.tensor([tree.logp[i] for i in tree.layer]), lp, r.width)
    finally:
        for r in requests:
            if runner.has_pending(r.rid):
                runner.discard_tree(r.rid)
    return trees, forwards
