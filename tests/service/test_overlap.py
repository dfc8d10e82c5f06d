"""Drafting ahead (`--overlap`, gateway/engine/overlap.py): the guess, the re-rooted tree, and the engine with it on
against real draft and target services: greedy output equals the target alone, trees drafted ahead are
used, a request that ends (or is aborted) while its next tree is drafted leaves no KV in either service.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_overlap.py.
"""

from __future__ import annotations

import asyncio

from tests.support.engine import Steered, idle, serve


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
