"""Drafting ahead (`--overlap`, gateway/engine/overlap.py): the guess, the re-rooted tree, and the engine with it on
against real draft and target services: greedy output equals the target alone, trees drafted ahead are
used, a request that ends (or is aborted) while its next tree is drafted leaves no KV in either service.

Here: the tests that start no process and open no socket; the others are in tests/service/test_overlap.py.
"""

from __future__ import annotations

from specserve.gateway.engine.overlap import Guess, assumed_path, next_tree
from specserve.gateway.sched.policy.base import CandidateTree
from tests.support.engine import MAX_TOKENS

#        0(root=10)
#       /         \
#    1(11)        2(12)
#    /   \          |
#  3(13) 4(14)    5(15)
#   |
#  6(16)
TREE = CandidateTree([10, 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3],
                     [1.0, 0.6, 0.3, 0.4, 0.15, 0.2, 0.3])


def test_assumed_path_is_the_likeliest_selected_leaf():
    assert assumed_path(TREE, [0]) == []
    assert assumed_path(TREE, [0, 1, 2]) == [11]  # leaves 1 (0.6) and 2 (0.3)
    assert assumed_path(TREE, [0, 1, 2, 3, 5]) == [11, 13]  # 3 (0.4) beats 5 (0.2)
    assert assumed_path(TREE, [0, 1, 2, 3, 4, 5, 6]) == [11, 13, 16]


def test_reroot_keeps_the_subtree_with_conditional_probabilities():
    sub = TREE.rerooted(1, 5)
    assert sub.tokens == [11, 13, 14, 16] and sub.parents == [-1, 0, 0, 1]
    assert sub.path_prob == [1.0, 0.4 / 0.6, 0.15 / 0.6, 0.3 / 0.6]
    cut = TREE.rerooted(0, 1)  # the root itself, cut to one level
    assert cut.tokens == [10, 11, 12] and cut.parents == [-1, 0, 0]


def test_next_tree_only_on_the_guessed_answer():
    guess = Guess([7, 8], 8, 5)  # tree grown from token 8, after assuming 7, 8 accepted
    ahead = CandidateTree([8, 20, 21, 22, 23], [-1, 0, 0, 1, 2], [1.0, 0.5, 0.25, 0.25, 0.1])
    hit = next_tree(guess, ahead, [7, 8, 21])
    assert hit is not None and hit.tokens == [21, 23] and hit.parents == [-1, 0]
    assert next_tree(guess, ahead, [7, 8, 99]) is None  # the bonus is not a guessed child
    assert next_tree(guess, ahead, [7, 21]) is None  # 8 was rejected
    assert next_tree(guess, ahead, [7, 8, 20, 22]) is None  # more emitted than guessed
    assert next_tree(Guess([], 8, 5), ahead, [20]).tokens == [20, 22]  # guessed from the root


def test_max_tokens_fits(prompts_and_reference):
    prompts, _ = prompts_and_reference
    assert all(len(ref) == MAX_TOKENS for _, ref in prompts)  # the references ran to max_tokens
