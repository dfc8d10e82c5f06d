"""The n-gram draft (services/draft/ngram.py): trees from the request's own tokens.

Unit (fast): the tree of a known history (longest suffix, most recent occurrences, width per layer,
path probabilities as shares of occurrences), a chain at width 1, a root-only tree with no match, and
against a brute-force trie on random histories. Engine (fast): the DraftEngine protocol with no model
(history, checks, assumed tokens forgotten, releases, stats with every block free). Stack (slow):
`specserve up --draft-model ngram` gives transformers' greedy text under every policy, speculating.

Here: the tests that start no process and open no socket; the others are in tests/stack/test_ngram_draft.py.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from specserve.draft.config import DraftConfig
from specserve.draft.ngram import NgramDraftEngine, ngram_tree
from specserve.shared.wire.messages import Speculate, SpeculateEntry


def paths(tree) -> dict[tuple[int, ...], float]:
    """Each node's token path below the root, with its path probability."""
    out: dict[tuple[int, ...], float] = {}
    path: dict[int, tuple[int, ...]] = {0: ()}
    for i in range(1, len(tree.tokens)):
        path[i] = path[tree.parents[i]] + (tree.tokens[i],)
        out[path[i]] = math.exp(tree.logp[i])
    return out


def test_the_longest_suffix_and_its_continuations():
    # the suffix "1 2 3" occurred twice before (its 4-gram never): followed by 4 5 and by 7 8
    seq = [1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 9, 1, 2, 3]
    tree = ngram_tree(seq, depth=2, width=2)
    assert tree.tokens[0] == 3 and tree.parents[0] == -1 and tree.logp[0] == 0.0
    assert paths(tree) == pytest.approx({(4,): 0.5, (7,): 0.5, (4, 5): 0.5, (7, 8): 0.5})
    chain = ngram_tree(seq, depth=3, width=1)
    assert list(paths(chain)) == [(7,), (7, 8), (7, 8, 9)]  # a tie goes to the most recent occurrence
    assert ngram_tree([5, 6, 7], depth=4, width=2).tokens == [7]  # nothing matches: the root alone
    assert ngram_tree(seq, depth=0, width=4).tokens == [3]


def brute(seq: list[int], depth: int, width: int) -> dict[tuple[int, ...], float]:
    """The tree by its definition: the most recent 32 occurrences of the longest earlier suffix (of at
    most 4 tokens); per layer the `width` paths followed most often among the children of the kept
    paths (ties: the parent kept first, then the continuation seen in the newest occurrence)."""
    for n in range(min(4, len(seq) - 1), 0, -1):
        starts = [i + n for i in range(len(seq) - n) if seq[i:i + n] == seq[-n:]][-32:][::-1]
        if starts:
            break
    else:
        return {}
    conts = [tuple(seq[s:s + depth]) for s in starts]
    counts = Counter(c[:k] for c in conts for k in range(1, len(c) + 1))
    kept: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[int, ...]] = [()]
    for k in range(1, depth + 1):
        children = [p for parent in frontier for p in dict.fromkeys(c[:k] for c in conts
                                                                   if len(c) >= k and c[:k - 1] == parent)]
        frontier = sorted(children, key=lambda p: -counts[p])[:width]
        kept.update({p: counts[p] / len(conts) for p in frontier})
    return kept


@pytest.mark.parametrize("seed", range(30))
def test_matches_a_brute_force_trie(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(5) for _ in range(rng.randrange(2, 120))]
    depth, width = rng.randrange(1, 6), rng.randrange(1, 5)
    tree = ngram_tree(seq, depth, width)
    assert paths(tree) == pytest.approx(brute(seq, depth, width)), seed
    assert all(tree.parents[i] < i for i in range(1, len(tree.tokens)))


def test_the_engine_speaks_the_draft_protocol_without_a_model():
    engine = NgramDraftEngine(DraftConfig(model="ngram"))
    prompt = [10, 11, 12, 13, 10, 11, 12]
    tensors = {"tokens": torch.tensor(prompt, dtype=torch.int32)}
    reply, out = engine.speculate(Speculate([SpeculateEntry("a", 0, len(prompt), len(prompt), 3, 2)]), tensors)
    assert reply.trees[0].error is None and reply.trees[0].depth == 3
    assert out["tokens"].tolist() == [12, 13, 10, 11] and out["parents"].tolist() == [-1, 0, 1, 2]
    # a guessed token (drafting ahead) is drafted from, then forgotten
    reply, out = engine.speculate(Speculate([SpeculateEntry("a", 1, 1, len(prompt), 2, 1, num_assumed=1)]),
                                  {"tokens": torch.tensor([13], dtype=torch.int32)})
    assert reply.trees[0].error is None and out["tokens"].tolist() == [13, 10, 11]
    assert engine.requests["a"].tokens == prompt
    stale = engine.speculate(Speculate([SpeculateEntry("a", 1, 0, len(prompt), 2, 1)]),
                             {"tokens": torch.empty(0, dtype=torch.int32)})[0]
    assert stale.trees[0].error.code == "stale_step"
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.resident_requests == 1
    assert engine.release("a") and engine.stats().resident_requests == 0
