"""One step ahead (--async-scheduling): the target fills in a root sent before it was known and verifies a chain
drafted on a guess of the step before it as that step's answer makes it, and the gateway's bookkeeping of
entries in flight (engine/ahead.py). End to end: tests/stack/test_gateway.py."""

from __future__ import annotations

import pytest
import torch

from specserve.gateway.engine import ahead
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.sched.plan import NO_DRAFT, IterationPlan, Residency, Shape
from specserve.gateway.sched.policy.base import CandidateTree
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.spec.token_tree import guessed_tree
from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec, VerifyEntry
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine

PROMPT = [72, 400, 1201, 33, 9, 870, 41, 5]


def _verify(step: int, committed: int, root: int, pending: bool) -> tuple[Forward, dict[str, torch.Tensor]]:
    return (Forward(verify=[VerifyEntry("a", step, committed, 1, root_pending=pending)]),
            {"tree_tokens": torch.tensor([root], dtype=torch.int32),
             "tree_parents": torch.tensor([-1], dtype=torch.int32)})


def test_the_target_takes_its_newest_token_as_a_pending_root_and_still_checks_the_count() -> None:
    engine = TargetEngine(TargetConfig(kv_blocks=32, threads=1))
    _, first = engine.forward(Forward(prefill=[PrefillEntry("a", 1, 0, len(PROMPT), True, SamplingSpec())]),
                              {"prefill_tokens": torch.tensor(PROMPT, dtype=torch.int32)})
    t1 = int(first["tokens"][0])
    # the reference: steps sent with the root known
    reference = TargetEngine(TargetConfig(kv_blocks=32, threads=1))
    reference.forward(Forward(prefill=[PrefillEntry("a", 1, 0, len(PROMPT), True, SamplingSpec())]),
                      {"prefill_tokens": torch.tensor(PROMPT, dtype=torch.int32)})
    _, known = reference.forward(*_verify(2, len(PROMPT) + 1, t1, False))

    # a root sent as a placeholder (0, not the token) is the target's own newest token
    reply, out = engine.forward(*_verify(2, len(PROMPT) + 1, 0, True))
    assert reply.results[0].error is None and out["tokens"].tolist() == known["tokens"].tolist()
    # a wrong placeholder without the flag is refused; so is a pending root at a count the target does not have
    assert engine.forward(*_verify(3, len(PROMPT) + 2, 0, False))[0].results[0].error.code == "out_of_sync"
    assert engine.forward(*_verify(4, len(PROMPT) + 5, 0, True))[0].results[0].error.code == "out_of_sync"


def _request(max_tokens: int = 8) -> GenRequest:
    r = GenRequest("a", [1, 2, 3], SamplingSpec(), max_tokens, SloClass("chat", 50.0, 1000.0), frozenset())
    r.output = [7]
    return r


def _root_only(r: GenRequest, step: int) -> tuple[int, bool] | None:
    """A root-only entry sent ahead: its committed count and whether its root is pending."""
    sent = ahead.decode_entry(r, step, [r.output[-1]], [-1], None)
    return None if sent is None else (sent.base, sent.pending)


def test_an_entry_sent_ahead_counts_the_token_in_flight_and_stops_before_max_tokens() -> None:
    r = _request(max_tokens=3)
    assert _root_only(r, 10) == (4, False)  # nothing in flight: its own root and count
    assert _root_only(r, 11) == (5, True)  # step 10 in flight: the target fills in the root
    r.output.append(8)  # step 10's token is committed; 11's is in flight and is the 3rd, its last
    assert ahead.settle(r, 10, ok=True) and r.ahead_step == 11
    assert _root_only(r, 12) is None
    assert ahead.settle(r, 11, ok=True) and r.ahead_step == 0 and r.sent_ahead is None


def _chain_ahead(accepted: list[int]) -> tuple[GenRequest, ahead.SentAhead]:
    """Step 10 verifies the chain 7 -> 8 -> 9 (nothing in flight before it); step 11 is sent while it runs,
    drafted on a guess of its answer (8, 9 accepted, then the bonus 10) as the chain 10 -> 11 -> 12 under a
    placeholder root, 9; then step 10's `accepted` tokens are committed."""
    from specserve.gateway.perf.record import RequestStep

    r = _request(max_tokens=20)
    first = ahead.decode_entry(r, 10, [7, 8, 9], [-1, 0, 1], None)
    assert first is not None and (first.base, first.pending, first.guess, first.path) == (4, False, 0, [8, 9])
    drafted = {"a": CandidateTree([9, 10, 11, 12], [-1, 0, 1, 2], [1.0, 0.9, 0.8, 0.7])}
    placeholders = ahead.under_guesses(drafted, {"a": 9})
    assert placeholders == {"a": 9} and drafted["a"].tokens == [10, 11, 12]  # under the guessed bonus
    tree = drafted["a"]
    second = ahead.decode_entry(r, 11, tree.tokens, tree.parents, placeholders["a"])
    assert second is not None and second.entry is None
    assert (second.base, second.pending, second.guess) == (5, True, 2)  # 5 at least, 7 where 8, 9 are accepted
    assert (second.tokens, second.parents, second.path) == ([9, 10, 11, 12], [-1, 0, 1, 2], None)
    second.entry = RequestStep("a", 0, depth=3, verified=3)
    r.output += accepted
    assert ahead.settle(r, 10, ok=True) and r.ahead_step == 11  # step 11 stays in flight
    ahead.resolve(r, 10)
    return r, second


def test_a_chain_sent_ahead_on_a_guess_is_resolved_as_the_target_resolves_it() -> None:
    _, hit = _chain_ahead([8, 9, 10])  # the guess came true: 10 -> 11 -> 12 is verified, 11 and 12 the drafts
    assert hit.path == [11, 12] and hit.entry is not None and (hit.entry.depth, hit.entry.verified) == (3, 3)
    r, miss = _chain_ahead([8, 5])  # 9 rejected, 5 the bonus: step 11 verifies its root alone
    assert miss.path == [] and miss.entry is not None and (miss.entry.depth, miss.entry.verified) == (0, 1)
    assert guessed_tree(miss.tokens, miss.parents, miss.base, miss.guess, r.committed, r.output[-1]) == ([5], [-1])
    _, wrong_bonus = _chain_ahead([8, 9, 4])
    assert wrong_bonus.path == [] and wrong_bonus.entry is not None and wrong_bonus.entry.verified == 1
    # with no tree drafted on a guess, the step after a chain sends its root alone for any answer of that chain
    r = _request(max_tokens=20)
    ahead.decode_entry(r, 10, [7, 8, 9], [-1, 0, 1], None)
    alone = ahead.decode_entry(r, 11, [7], [-1], None)
    assert alone is not None and (alone.base, alone.guess, alone.tokens, alone.path) == (5, 2, [7], [])
    # the next step, sent while 11 runs, is drafted on a guess of 11's answer: the chain it verifies, accepted
    r, hit = _chain_ahead([8, 9, 10])
    third = ahead.decode_entry(r, 12, [13, 14], [-1, 0], 12)
    assert third is not None and (third.base, third.guess, third.tokens) == (r.committed + 1, 2, [12, 13, 14])


def test_a_failed_entry_drops_the_one_sent_ahead_on_it() -> None:
    r = _request()
    _root_only(r, 10)
    _root_only(r, 11)
    assert ahead.settle(r, 10, ok=False)  # e.g. out_of_blocks, retried: step 11 was sent on a state not reached
    assert not ahead.settle(r, 11, ok=False)  # its refusal (out of sync) is dropped, not the request's end
    assert _root_only(r, 12) == (4, False)  # and the next entry starts again from what is committed


def test_a_request_off_its_replica_drops_what_it_had_in_flight() -> None:
    r = _request()
    _root_only(r, 10)
    r.chunk_step = 0
    ahead.unbound(r)
    assert r.ahead_step == 0 and not ahead.settle(r, 10, ok=True)
    assert ahead.settle(r, 12, ok=True)  # a later step, after it is bound again, counts


def _plan(shapes: dict[str, Shape], **kw) -> IterationPlan:
    return IterationPlan(1, [], {}, {}, {}, shapes, [], kw.pop("residency", Residency.KEEP), **kw)


def test_only_a_pass_that_needs_no_answer_of_the_one_in_flight_runs_ahead() -> None:
    r = _request()
    assert ahead.runs_ahead(_plan({"a": NO_DRAFT}), [r])
    assert ahead.runs_ahead(_plan({"a": Shape(3, 1)}), [r])  # a chain: drafted on a guess of the answer in flight
    assert not ahead.runs_ahead(_plan({"a": Shape(3, 2)}), [r])  # a tree of side branches is not
    assert not ahead.runs_ahead(_plan({"a": NO_DRAFT}, preempt=["a"]), [r])
    assert not ahead.runs_ahead(_plan({"a": NO_DRAFT}, residency=Residency.OFFLOAD), [r])
    assert not ahead.runs_ahead(_plan({"a": NO_DRAFT}, draft_sync=["a"]), [r])


def test_auto_goes_ahead_on_a_gpu_target_only_and_the_target_says_where_its_pass_runs() -> None:
    assert [ahead.ahead_on("auto", d) for d in ("cuda", "cpu", "simulated", "")] == [True, False, False, False]
    assert ahead.ahead_on("on", "cpu") and not ahead.ahead_on("off", "cuda")
    assert TargetEngine(TargetConfig(kv_blocks=16, threads=1)).stats().device == "cpu"


def test_a_pass_sent_ahead_is_timed_from_when_the_one_before_was_answered() -> None:
    # sent at 10.000 s, answered at 10.010 s (a 10 ms call); the pass before it was answered at 10.006 s
    assert ahead.queued_ms(10.006, 10.010, 10.0) == pytest.approx(6.0)
    assert ahead.queued_ms(9.990, 10.010, 10.0) == 0.0  # sent after the one before was answered: no wait
    assert ahead.queued_ms(10.020, 10.010, 10.0) == 10.0  # never more than the call


def test_a_plan_carried_out_after_a_pass_is_committed_passes_over_what_that_pass_ended() -> None:
    """The plan was made while a pass was in flight; that pass's commit ended one request and moved
    another: the plan's admission, rejection and preemption of them are passed over."""
    from specserve.gateway.backends.pool import ServicePool, TargetReplica
    from specserve.gateway.config import GatewayConfig
    from specserve.gateway.engine.loop import Engine
    from specserve.gateway.obs.metrics import GatewayMetrics
    from specserve.gateway.perf.cost import PassCost
    from specserve.gateway.sched.plan import Admit, Reject
    from specserve.gateway.sched.routing import RoundRobin
    from specserve.gateway.sched.scheduler import Scheduler
    from tests.support.engine import Steered

    replicas = [TargetReplica(0, "unix:/a", PassCost(16, 10.0))]
    policy = Steered()
    engine = Engine(policy, Scheduler(policy, RoundRobin()), ServicePool(replicas, None), GatewayMetrics("t"),
                    GatewayConfig())
    waiting = _request()
    waiting.rid, waiting.output = "w", []
    engine.table.requests["w"] = waiting
    plan = IterationPlan(1, [Admit("gone", 0), Admit("w", 0)], {}, {"gone-too": Reject("full")}, {}, {}, [],
                         Residency.KEEP, preempt=["w", "gone"])
    engine.table.waiting.append(waiting)
    record = engine.admitter.apply(plan)  # "gone" ended; "w" is waiting, so it is not preempted but admitted
    assert waiting.replica == 0 and record.admitted == 2 and "gone" not in engine.table.requests


def test_a_failed_prompt_chunk_drops_the_next_chunk_sent_ahead_on_it() -> None:
    r = _request()
    r.output = []
    r.chunk_step, r.chunk_end = 10, 16  # chunk [0, 16) in flight at step 10
    r.chunk_step, r.chunk_end = 11, 32  # then [16, 32) sent ahead at step 11
    assert ahead.settle(r, 10, ok=True) and r.chunk_step == 11  # the first is in; the second still in flight
    assert ahead.settle(r, 11, ok=True) and r.chunk_step == 0
    r.chunk_step = 13
    assert ahead.settle(r, 12, ok=False) and r.chunk_step == 0  # step 12's chunk refused (out_of_blocks)...
    assert not ahead.settle(r, 13, ok=False)  # ...so step 13's, which started where 12's would end, is dropped


def _tree(step: int, committed: int, tokens: list[int], guess: int) -> tuple[Forward, dict[str, torch.Tensor]]:
    """A chain sent ahead: its root pending, drafted on a guess of `guess` accepted tokens of the step before."""
    return (Forward(verify=[VerifyEntry("a", step, committed, len(tokens), root_pending=True, guess=guess)]),
            {"tree_tokens": torch.tensor(tokens, dtype=torch.int32),
             "tree_parents": torch.tensor(list(range(-1, len(tokens) - 1)), dtype=torch.int32)})


def _prefilled() -> tuple[TargetEngine, int]:
    engine = TargetEngine(TargetConfig(kv_blocks=32, threads=1))
    _, first = engine.forward(Forward(prefill=[PrefillEntry("a", 1, 0, len(PROMPT), True, SamplingSpec())]),
                              {"prefill_tokens": torch.tensor(PROMPT, dtype=torch.int32)})
    return engine, int(first["tokens"][0])


def test_a_chain_drafted_on_a_guess_is_verified_under_the_bonus_it_guessed_or_its_root_alone() -> None:
    reference, t1 = _prefilled()
    greedy = [t1]
    for step in range(2, 10):  # the target's greedy continuation, one token a step
        _, out = reference.forward(*_verify(step, len(PROMPT) + len(greedy), greedy[-1], False))
        greedy.append(int(out["tokens"][0]))
    n = len(PROMPT) + 1  # committed once the first token is in

    def after_chain() -> TargetEngine:
        """Step 2 verified [t1, t2, t3]: both drafts right, t4 the bonus; n + 3 committed."""
        engine, _ = _prefilled()
        reply, out = engine.forward(*_verify_chain(2, n, greedy[:3]))
        assert out["tokens"].tolist() == greedy[1:4] and reply.results[0].num_accepted == 2
        return engine

    # step 3 was sent before step 2's answer: at least n + 1 committed, n + 3 where its 2 drafts are accepted;
    # the tree grows from the assumed t3 (a placeholder root), its first level the guessed bonus t4
    reply, out = after_chain().forward(*_tree(3, n + 1, [0, greedy[3], greedy[4], greedy[5]], guess=2))
    assert reply.results[0].error is None and out["tokens"].tolist() == greedy[4:7]  # t5, t6 accepted, t7 bonus
    assert reply.results[0].num_accepted == 2
    # a wrong guess of the bonus: its root alone
    reply, out = after_chain().forward(*_tree(3, n + 1, [0, 999, greedy[4]], guess=2))
    assert reply.results[0].error is None and out["tokens"].tolist() == greedy[4:5]
    # a guess of more accepted tokens than were: its root alone, at the count the target has
    reply, out = after_chain().forward(*_tree(3, n + 1, [0, greedy[3], greedy[4]], guess=3))
    assert reply.results[0].error is None and out["tokens"].tolist() == greedy[4:5]
    # its root alone, sent after the chain with a range of counts (the chain's drafts): on the plain decodes' path
    # and on the per-entry one alike
    for batched in (True, False):
        engine = after_chain()
        engine.batched_decodes = batched
        reply, out = engine.forward(*_tree(3, n + 1, [0], guess=2))
        assert reply.results[0].error is None and out["tokens"].tolist() == greedy[4:5], batched
        assert engine.forward(*_tree(4, n + 1, [0], guess=1))[0].results[0].error.code == "out_of_sync", batched
    # a count outside what the step before could leave is refused, changing nothing
    engine = after_chain()
    assert engine.forward(*_tree(3, n + 1, [0, greedy[3], greedy[4]], guess=1))[0].results[0].error.code == \
        "out_of_sync"
    assert engine.forward(*_tree(4, n + 3, [0, greedy[4]], guess=0))[0].results[0].error is None


def _verify_chain(step: int, committed: int, tokens: list[int]) -> tuple[Forward, dict[str, torch.Tensor]]:
    return (Forward(verify=[VerifyEntry("a", step, committed, len(tokens))]),
            {"tree_tokens": torch.tensor(tokens, dtype=torch.int32),
             "tree_parents": torch.tensor(list(range(-1, len(tokens) - 1)), dtype=torch.int32)})
