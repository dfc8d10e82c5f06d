"""One step ahead (--async-scheduling): the target fills in a root sent before it was known, and the
gateway's bookkeeping of entries in flight (engine/ahead.py). End to end: tests/stack/test_gateway.py."""

from __future__ import annotations

import pytest
import torch

from specserve.gateway.engine import ahead
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.sched.plan import NO_DRAFT, IterationPlan, Residency, Shape
from specserve.gateway.sched.slo_classes import SloClass
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


def test_an_entry_sent_ahead_counts_the_token_in_flight_and_stops_before_max_tokens() -> None:
    r = _request(max_tokens=3)
    assert ahead.decode_entry(r, 10) == (4, False)  # nothing in flight: its own root and count
    assert ahead.decode_entry(r, 11) == (5, True)  # step 10 in flight: the target fills in the root
    r.output.append(8)  # step 10's token is committed; 11's is in flight and is the 3rd, its last
    assert ahead.settle(r, 10, ok=True) and r.ahead_step == 11
    assert ahead.decode_entry(r, 12) is None
    assert ahead.settle(r, 11, ok=True) and r.ahead_step == 0


def test_a_failed_entry_drops_the_one_sent_ahead_on_it() -> None:
    r = _request()
    ahead.decode_entry(r, 10)
    ahead.decode_entry(r, 11)
    assert ahead.settle(r, 10, ok=False)  # e.g. out_of_blocks, retried: step 11 was sent on a state not reached
    assert not ahead.settle(r, 11, ok=False)  # its refusal (out of sync) is dropped, not the request's end
    assert ahead.decode_entry(r, 12) == (4, False)  # and the next entry starts again from what is committed


def test_a_request_off_its_replica_drops_what_it_had_in_flight() -> None:
    r = _request()
    ahead.decode_entry(r, 10)
    r.chunk_step = 0
    ahead.unbound(r)
    assert r.ahead_step == 0 and not ahead.settle(r, 10, ok=True)
    assert ahead.settle(r, 12, ok=True)  # a later step, after it is bound again, counts


def _plan(shapes: dict[str, Shape], **kw) -> IterationPlan:
    return IterationPlan(1, [], {}, {}, {}, shapes, [], kw.pop("residency", Residency.KEEP), **kw)


def test_only_a_pass_that_needs_no_answer_of_the_one_in_flight_runs_ahead() -> None:
    r = _request()
    assert ahead.runs_ahead(_plan({"a": NO_DRAFT}), [r])
    assert not ahead.runs_ahead(_plan({"a": Shape(3, 1)}), [r])  # a draft tree grows from the unknown root
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
