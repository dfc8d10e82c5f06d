"""The engine in-process against real draft and target services: plans that move the draft (offload,
reload) and the eager draft sync stay lossless, and the IterationRecord says what happened.

The policy here is a test policy built on the real chain policy: it only adds a residency change or
turns speculation off on chosen iterations, as Nightjar and TurboSpec will.

Here: the tests that start no process and open no socket; the others are in tests/service/test_engine.py.
"""

from __future__ import annotations

import pytest

from specserve.gateway.backends.pool import ServicePool, TargetReplica
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.loop import Engine
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.routing import RoundRobin
from specserve.gateway.sched.scheduler import Scheduler
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.wire.messages import SamplingSpec
from tests.support.engine import Steered


def test_a_request_larger_than_every_pool_is_named_with_the_pool_size():
    """`pool_tokens_short`: the largest replica's pool in tokens when even it cannot hold the request's
    worst case (prompt + max_tokens + the tree slack), None when it can or while no pool is known."""
    replicas = [TargetReplica(0, "unix:/a", PassCost(16, 10.0)), TargetReplica(1, "unix:/b", PassCost(16, 10.0))]
    policy = Steered()
    engine = Engine(policy, Scheduler(policy, RoundRobin()), ServicePool(replicas, None), GatewayMetrics("t"),
                    GatewayConfig(tree_slack_tokens=64))
    assert engine.intake.pool_tokens_short(10_000, 10_000) is None  # no pool size known yet
    replicas[0].total_blocks, replicas[1].total_blocks = 8, 20  # 128 and 320 tokens
    assert engine.intake.pool_tokens_short(100, 156) is None  # 100 + 156 + 64 = 320 tokens: the larger pool
    assert engine.intake.pool_tokens_short(100, 157) == 320


def test_a_finished_request_meets_its_slo_only_with_both_its_ttft_and_its_tpot_in_time():
    """What the gateway counts in specserve:request_slo_total and the trace's specserve.slo.met."""

    def finished(first_s: float, gap_s: float, tokens: int = 4) -> GenRequest:
        r = GenRequest("r", [1, 2], SamplingSpec(), 8, SloClass("chat", 50.0, 1000.0), frozenset(), arrival=100.0)
        r.token_times = [100.0 + first_s + i * gap_s for i in range(tokens)]
        return r

    assert finished(0.5, 0.04).slo_met()
    assert not finished(1.5, 0.04).slo_met()  # TPOT met, the first token late
    assert not finished(0.5, 0.06).slo_met()  # TTFT met, the tokens slow
    assert finished(0.5, 9.0, tokens=1).slo_met()  # one token: no TPOT to miss
    assert finished(1.5, 0.04).ttft_s() == pytest.approx(1.5) and finished(0, 0, tokens=0).ttft_s() is None
    assert not finished(0, 0, tokens=0).slo_met()


def test_the_arrival_check_counts_the_prompts_due_before_a_request_by_ttft_deadline():
    """`Intake.tokens_due_before`: SLO-aware admission chunks prompts by TTFT deadline, so a new request waits
    on the waiting and prefilling prompts due no later than it, not on a long prompt prefilling with a later
    deadline (nor on one in the best-effort tier, nor on a request that decodes)."""
    replicas = [TargetReplica(0, "unix:/a", PassCost(16, 10.0))]
    policy = Steered()
    engine = Engine(policy, Scheduler(policy, RoundRobin()), ServicePool(replicas, None), GatewayMetrics("t"),
                    GatewayConfig())

    def request(rid: str, prompt: int, ttft_ms: float, arrival: float = 100.0) -> GenRequest:
        return GenRequest(rid, [1] * prompt, SamplingSpec(), 8, SloClass("x", 50.0, ttft_ms), frozenset(),
                          arrival=arrival)

    chat = request("chat", 1300, 5000.0)  # prefilling, due at 105 s, 300 tokens in
    urgent = request("urgent", 200, 1500.0)  # prefilling, due at 101.5 s
    spare = request("spare", 400, 1000.0)  # prefilling best effort
    for r in (chat, urgent, spare):
        engine.table.queue(r)
        engine.table.bind(r, 0)
    chat.prefilled, spare.served_best_effort = 300, True
    engine.table.queue(request("queued", 50, 2000.0, arrival=100.5))  # waiting, due at 102.5 s
    search = request("search", 80, 2000.0, arrival=101.0)  # due at 103 s
    assert engine.intake.tokens_due_before(search) == 200 + 50
    assert engine.intake.tokens_due_before(request("late", 80, 5000.0, arrival=101.0)) == 1000 + 200 + 50
    urgent.output = [7]  # decoding: no prompt left to compute
    assert engine.intake.tokens_due_before(search) == 50
