"""Drafting ahead (`--overlap`, gateway/engine/overlap.py): the guess, the re-rooted tree, and the engine with it on
against real draft and target services: greedy output equals the target alone, trees drafted ahead are
used, a request that ends (or is aborted) while its next tree is drafted leaves no KV in either service.
"""

from __future__ import annotations

import asyncio

from specserve.gateway.engine.overlap import Guess, assumed_path, next_tree, reroot
from specserve.gateway.sched.policy.base import CandidateTree
from tests.support.engine import MAX_TOKENS, Steered, idle, serve

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
    sub = reroot(TREE, 1, 5)
    assert sub.tokens == [11, 13, 14, 16] and sub.parents == [-1, 0, 0, 1]
    assert sub.path_prob == [1.0, 0.4 / 0.6, 0.15 / 0.6, 0.3 / 0.6]
    cut = reroot(TREE, 0, 1)  # the root itself, cut to one level
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


def test_overlap_is_lossless_and_uses_its_trees(services, prompts_and_reference):
    prompts, stops = prompts_and_reference
    for off_every, draft_misses in ((0, False), (0, True), (3, True)):
        # chain:3 every iteration, or d = 0 on two iterations of three; a miss verifies its root alone, or
        # drafts its tree before the pass
        policy = Steered(off_every=off_every)
        out = asyncio.run(serve(policy, services, prompts, stops, sync=False, overlap=True,
                                draft_misses=draft_misses))
        assert out == [ref for _, ref in prompts], off_every
        recs = policy.records
        calls, ahead = sum(r.draft.requests for r in recs), sum(r.draft.ahead for r in recs)
        hits = sum(r.draft.ahead_hits for r in recs)
        assert 0 < hits <= ahead, (hits, ahead)
        if not draft_misses:
            assert calls == 0, "a draft call before the pass with --overlap-miss root"
        else:  # a hit's tree is verified next step without a call before the pass (unless the policy then
            # says d = 0, as with off_every 3: the tree is dropped)
            assert (calls < ahead) == (off_every == 0), (calls, ahead)
        for r in recs:  # the four parts of the split add up to the iteration
            parts = r.draft_ms + r.target_ms + r.transport_ms + r.schedule_ms
            assert abs(parts - r.total_ms) <= 1e-6 * max(1.0, r.total_ms)
        asyncio.run(idle(services))


def test_overlap_end_and_abort_while_drafting_ahead(services, prompts_and_reference):
    """A request ends in a step whose draft call beside the pass grew its next tree (max_tokens 7), one is
    aborted while the next pass runs; neither service keeps any KV."""
    prompts, stops = prompts_and_reference
    policy = Steered()
    out = asyncio.run(serve(policy, services, prompts, stops, sync=False, overlap=True, abort=1, max_tokens=7))
    assert out[0] == prompts[0][1][:7] and out[2] == prompts[2][1][:7]
    assert out[1] == prompts[1][1][: len(out[1])]
    last = {s.rid: i for i, r in enumerate(policy.records) for s in r.requests}
    # (a request with one token left speculates no more: d is capped at remaining - 1)
    assert any(policy.records[last[rid]].draft.ahead > 0 for rid in ("r0", "r2")), \
        "no request ended in a step that drafted ahead"
    asyncio.run(idle(services))


def test_max_tokens_fits(prompts_and_reference):
    prompts, _ = prompts_and_reference
    assert all(len(ref) == MAX_TOKENS for _, ref in prompts)  # the references ran to max_tokens
