"""A request's grammar during generation: its xgrammar matcher, and its trees shaped and masked by it.

The matcher stands after the request's committed output. Each iteration `shape` turns the tree the
request will verify (the draft's, or its root alone) into one the grammar allows:

1. forced tokens: where the grammar allows exactly one next token, or a string that must come next
   (xgrammar's jump-forward string, tokenized), those tokens go into the tree as a chain from the root,
   through the draft's nodes where they hold the same tokens. A single allowed token is accepted
   for certain under greedy decoding (under sampling the mask gives it probability 1); a forced
   string's tokens are a guess at its tokenization, verified like any draft token;
2. masks: the allowed-token bitmask at every node (xgrammar's `traverse_draft_tree`): row v is what
   may follow the path to v;
3. pruning: a node whose token its parent's row forbids goes, with its subtree, so that the target
   never verifies what the grammar forbids.

The target applies each node's row to its logits (shared/spec/token_mask.py) before its greedy
choice, sampling and acceptance, so every emitted token obeys the grammar at every position, and
greedy output is the same whatever the tree. `accept` advances the matcher by the emitted tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.gateway.sched.policy.base import CandidateTree
from specserve.shared.spec.token_mask import words_for

if TYPE_CHECKING:
    import xgrammar


@dataclass(slots=True)
class Shaped:
    """One iteration's tree of a request with a grammar: the tree, every node's mask row, and the nodes
    of its forced chain (verified whatever the policy selects)."""

    tree: CandidateTree
    masks: torch.Tensor  # int32 [nodes, ceil(V / 32)]
    forced: list[int]

    def rows(self, nodes: list[int]) -> torch.Tensor:
        """The mask rows of a selection, in node order (as CandidateTree.subtree orders its tokens)."""
        return self.masks[sorted(nodes)]


class Constraint:
    """A request's grammar state: the matcher after its committed output, and this iteration's `Shaped`."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int, encode: Callable[[str], list[int]]):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.words = words_for(vocab_size)
        self.encode = encode
        self.shaped: Shaped | None = None
        self._row = torch.zeros(1, self.words, dtype=torch.int32)
        self._stop_words: dict[int, int] = {}  # word -> the bits of the grammar's stop tokens in it
        for t in self.matcher.stop_token_ids:
            self._stop_words[t >> 5] = self._stop_words.get(t >> 5, 0) | (1 << (t & 31))

    @property
    def terminated(self) -> bool:
        """The grammar has accepted its stop token: the output is complete."""
        return bool(self.matcher.is_terminated())

    def accept(self, token: int) -> bool:
        """Advance by one emitted token; False if the grammar does not allow it (the matcher is unchanged)."""
        return bool(self.matcher.accept_token(token))

    def dead_end(self) -> bool:
        """The grammar allows no next token here but its stop token, and has not ended: the output can go
        no further (a grammar can lead where nothing follows, e.g. the regex `a[^\\s\\S]` after "a"; and
        where it allows only its end, min_tokens may have forbidden that end)."""
        if self.terminated:
            return False
        allowed = self.first_mask()[0].numpy().astype(np.int64) & 0xFFFFFFFF
        for word, bits in self._stop_words.items():
            allowed[word] &= ~bits
        return not allowed.any()

    def first_mask(self) -> torch.Tensor:
        """int32 [1, W]: the tokens allowed now (at a prompt's last position: the first output token)."""
        row = torch.zeros(1, self.words, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(row)
        return row

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces after the current state (the matcher is left as it was)."""
        chain: list[int] = []
        matcher, row = self.matcher, self._row
        try:
            while len(chain) < limit and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(row)
                token = single_token(row[0].numpy())
                if token is not None:
                    matcher.accept_token(token)
                    chain.append(token)
                    continue
                text = matcher.find_jump_forward_string()
                before = len(chain)
                for t in self.encode(text)[: limit - len(chain)] if text else []:
                    if not matcher.accept_token(t):
                        break
                    chain.append(t)
                if len(chain) == before:
                    break
        finally:
            if chain:
                matcher.rollback(len(chain))
        return chain

    def shape(self, tree: CandidateTree, limit: int) -> CandidateTree:
        """`tree` with up to `limit` forced tokens grafted at its root and every forbidden node pruned; its
        masks and forced chain kept in `shaped` for this iteration's pass."""
        tree, forced = graft(tree, self.forced(max(0, limit)))
        masks = self.masks(tree)
        self.shaped = prune(tree, masks, forced)
        return self.shaped.tree

    def take_shaped(self, tree: CandidateTree | None, root: int) -> Shaped:
        """This iteration's `Shaped` (the tree `shape` returned, or None for its root alone), once; a tree it
        did not shape gets its masks now (no forced tokens; a forbidden node is never reached, its parent's
        row refusing it)."""
        shaped, self.shaped = self.shaped, None
        if shaped is not None and (shaped.tree is tree or (tree is None and len(shaped.tree.tokens) == 1)):
            return shaped
        tree = tree or CandidateTree.root_only(root)
        return Shaped(tree, self.masks(tree), [])

    def masks(self, tree: CandidateTree) -> torch.Tensor:
        """int32 [nodes, W]: each node's allowed next tokens; the rows of nodes the grammar refuses (and of
        their subtrees) are left zero."""
        n = len(tree.tokens)
        masks = torch.zeros(n, self.words, dtype=torch.int32)
        if n == 1:
            self.matcher.fill_next_token_bitmask(masks)
            return masks
        first_child = np.full(n, -1, dtype=np.int64)
        next_sibling = np.full(n, -1, dtype=np.int64)
        for v, kids in enumerate(tree.children):
            if kids:
                first_child[v] = kids[0]
                for a, b in zip(kids, kids[1:]):
                    next_sibling[a] = b
        self.matcher.traverse_draft_tree(torch.from_numpy(first_child), torch.from_numpy(next_sibling),
                                         torch.tensor(tree.tokens, dtype=torch.int64), masks)
        return masks


def single_token(row: np.ndarray) -> int | None:
    """The one token a mask row allows, or None if it allows none or several."""
    nonzero = np.flatnonzero(row)
    if len(nonzero) != 1:
        return None
    word = int(row[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


def allows(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def graft(tree: CandidateTree, chain: list[int]) -> tuple[CandidateTree, list[int]]:
    """`chain` as a path from the root: through the draft's nodes of the same tokens, then new nodes. The
    chain's nodes get the root's path probability (they are the grammar's, not the draft's guesses), and
    the draft's subtree below its end its probabilities given that end. Returns the tree and the chain's
    node indices."""
    if not chain:
        return tree, []
    tokens, parents, probs = list(tree.tokens), list(tree.parents), list(tree.path_prob)
    children = [list(kids) for kids in tree.children]
    node, forced = 0, []
    for t in chain:
        child = next((c for c in children[node] if tokens[c] == t), None)
        if child is None:
            child = len(tokens)
            tokens.append(t)
            parents.append(node)
            probs.append(probs[0])
            children.append([])
            children[node].append(child)
        forced.append(child)
        node = child
    end = probs[node]
    if node < len(tree.tokens) and 0 < end < 1:  # the draft's subtree under the chain's end, given the end
        below = [False] * len(tree.tokens)
        below[node] = True
        for v in range(node + 1, len(tree.tokens)):
            below[v] = below[parents[v]]
            if below[v]:
                probs[v] = min(1.0, probs[v] / end)
    for v in forced:
        probs[v] = probs[0]
    return CandidateTree(tokens, parents, probs), forced


def prune(tree: CandidateTree, masks: torch.Tensor, forced: list[int]) -> Shaped:
    """Drop every node whose token its parent's row forbids, and its subtree; re-index what stays."""
    rows = masks.numpy()
    n = len(tree.tokens)
    keep = [True] * n
    for v in range(1, n):  # parents precede children
        p = tree.parents[v]
        keep[v] = keep[p] and allows(rows[p], tree.tokens[v])
    if all(keep):
        return Shaped(tree, masks, forced)
    kept = [v for v in range(n) if keep[v]]
    index = {v: i for i, v in enumerate(kept)}
    pruned = CandidateTree([tree.tokens[v] for v in kept], [index[tree.parents[v]] if v else -1 for v in kept],
                           [tree.path_prob[v] for v in kept])
    return Shaped(pruned, masks[kept], [index[v] for v in forced if v in index])


__all__ = ["Constraint", "Shaped", "allows", "graft", "prune", "single_token"]
