"""Token trees: node tokens plus parent indices, in topological order (parent index < node index).

Node 0 is the root: the request's last committed token (its KV is not in the target's cache yet).
Every other node is a draft token proposed as a continuation of its parent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class InvalidTree(ValueError):
    """A tree whose parents are not a valid topological encoding rooted at node 0."""


def validate_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    if len(tokens) == 0:
        raise InvalidTree("a token tree needs at least its root")
    if len(tokens) != len(parents):
        raise InvalidTree(f"{len(tokens)} tokens but {len(parents)} parent indices")
    if parents[0] != -1:
        raise InvalidTree("node 0 must be the root (parent -1)")
    for i in range(1, len(parents)):
        if not 0 <= parents[i] < i:
            raise InvalidTree(f"node {i} has parent {parents[i]}; parents must precede their children")


def depths(parents: Sequence[int]) -> list[int]:
    out = [0] * len(parents)
    for i in range(1, len(parents)):
        out[i] = out[parents[i]] + 1
    return out


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
    n = len(parents)
    ancestors: list[list[int]] = [[0]]  # per node: itself and its ancestors
    for i in range(1, n):
        ancestors.append(ancestors[parents[i]] + [i])
    rows = [i for i, anc in enumerate(ancestors) for _ in anc]
    cols = [j for anc in ancestors for j in anc]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[rows, cols] = True
    return mask


def children_by_token(tokens: Sequence[int], parents: Sequence[int]) -> list[dict[int, int]]:
    """Per node, a map from child token to child index (the first child wins on duplicate tokens)."""
    out: list[dict[int, int]] = [{} for _ in tokens]
    for i in range(1, len(tokens)):
        out[parents[i]].setdefault(int(tokens[i]), i)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root to `node`, inclusive."""
    path = [node]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]
