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


def validate_forest(parents: Sequence[int], count: int, prior: int = 0) -> None:
    """New nodes prior .. prior + count of a forest: each parent is -1 (a root) or an earlier node."""
    if len(parents) != count:
        raise InvalidTree(f"{count} tokens but {len(parents)} parent indices")
    for j, parent in enumerate(parents):
        if not -1 <= parent < prior + j:
            raise InvalidTree(f"node {prior + j} has parent {parent}; parents must be -1 or an earlier node")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node; a node whose parent is -1 (the root, or a forest root) has depth 0."""
    out = [0] * len(parents)
    for i, parent in enumerate(parents):
        if parent >= 0:
            out[i] = out[parent] + 1
    return out


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: mask[i, j] is True when node j is node i or one of its ancestors (forests too)."""
    n = len(parents)
    ancestors: list[list[int]] = []  # per node: its ancestors and itself
    for i, parent in enumerate(parents):
        ancestors.append((ancestors[parent] if parent >= 0 else []) + [i])
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


def guessed_tree(tokens: Sequence[int], parents: Sequence[int], low: int, guess: int, committed: int,
                 newest: int) -> tuple[list[int], list[int]] | None:
    """A tree drafted on a guess of the step before it (`VerifyEntry.guess`: that step leaves `low` committed
    tokens at least, and `low + guess` where it accepts the path the draft assumed), as the request's state
    after that step makes it (`committed` tokens, the `newest` one the root): where the guess came true, the
    subtree under the root's child whose token is `newest`, that child its root; otherwise the root alone;
    None where `committed` is outside low ... low + guess (a state the tree was not sent for). A node whose
    parent is not before it is left out, and with it its subtree."""
    if not low <= committed <= low + guess:
        return None
    kept, kept_parents = [newest], [-1]
    if committed == low + guess:
        child = next((v for v in range(1, len(tokens)) if parents[v] == 0 and tokens[v] == newest), None)
        if child is not None:
            index = {child: 0}
            for v in range(child + 1, len(tokens)):
                if parents[v] in index:
                    index[v] = len(kept)
                    kept.append(tokens[v])
                    kept_parents.append(index[parents[v]])
    return kept, kept_parents
