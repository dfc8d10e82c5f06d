"""Prefix caching in the gateway, no processes: the mirror of a replica's cache, the engine's figures from
it (a multi-turn conversation finds its history where it ran, a wrong guess is corrected, vLLM's
counters), the router's prefix affinity, and admission pricing a request at its uncached prompt."""

from __future__ import annotations

import asyncio

import pytest

from specserve.gateway.backends.pool import ServicePool, TargetReplica
from specserve.gateway.backends.prefix import PrefixMirror
from specserve.gateway.engine.prefix import PrefixCaches
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.admission.slo import SloAdmission
from specserve.gateway.sched.plan import DraftView, Limits, ReplicaView, RequestView, SchedulerView, WaitingView
from specserve.gateway.sched.policy import Policy
from specserve.gateway.sched.routing import Ledger, RoundRobin, make_router
from specserve.gateway.sched.scheduler import Scheduler
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.runtime.block_hash import block_hashes
from specserve.shared.wire.messages import SamplingSpec

BS = 16


def test_the_mirror_matches_prefixes_and_drops_the_least_recently_used() -> None:
    m = PrefixMirror()
    keys = block_hashes(list(range(5 * BS)), BS)
    assert m.match(keys) == 0
    m.insert(keys[:3])
    assert m.match(keys) == 3 and m.match(block_hashes(list(range(1, 5 * BS)), BS)) == 0
    m.insert(reversed(keys))  # tail first: the head is the most recently used
    m.trim(3)
    assert m.match(keys) == 3 and len(m) == 3
    m.insert(keys[1:])  # all but the head used again: the head is now the least recently used
    m.trim(3)
    assert m.match(keys) == 0 and len(m) == 3
    m.reset(True)
    assert len(m) == 0 and m.enabled


def _request(rid: str, prompt: list[int]) -> GenRequest:
    return GenRequest(rid, prompt, SamplingSpec(), 64, SloClass("chat", 50.0, 1000.0), frozenset())


def _pool() -> ServicePool:
    targets = []
    for i in range(2):
        t = TargetReplica(i, f"unix:/t{i}", PassCost(16, 10.0))
        t.total_blocks, t.block_size = 100, BS
        t.prefix.reset(True)
        targets.append(t)
    return ServicePool(targets, None)


def test_a_conversation_finds_its_history_where_it_ran() -> None:
    pool, metrics = _pool(), GatewayMetrics("demo")
    caches = PrefixCaches(pool, metrics)
    turn1 = _request("t1", list(range(100)))
    assert caches.per_replica(turn1) == ()  # nothing cached anywhere yet
    caches.admitted(turn1, pool.targets[1])
    assert turn1.cached == 0
    turn1.prefilled = 100
    caches.chunk_done(turn1, pool.targets[1], 0, 100, 0)
    turn1.output = list(range(500, 540))
    caches.released(turn1, pool.targets[1])  # its KV: every committed token but the newest, 139 tokens
    # the next turn re-sends the history and a new message
    turn2 = _request("t2", turn1.prompt + turn1.output + list(range(900, 930)))
    assert caches.per_replica(turn2) == (0, 128)
    caches.admitted(turn2, pool.targets[1])
    assert turn2.cached == 128
    # the replica held less than the mirror said (it evicted some) and computed the rest: it holds them all now
    turn2.prefilled = 170
    caches.chunk_done(turn2, pool.targets[1], 0, 170, 64)
    assert pool.targets[1].prefix.match(turn2.keys(BS, 169)) == 10
    assert turn2.cached_tokens == 64
    same = _request("t3", list(turn2.prompt))
    assert caches.expected(same, pool.targets[1]) == 160  # its last token is always computed
    text = metrics.render()
    assert "vllm:prefix_cache_queries_total{model_name=\"demo\"} 270.0" in text
    assert "vllm:prefix_cache_hits_total{model_name=\"demo\"} 64.0" in text
    pool.targets[0].prefix.reset(False)  # a replica that keeps no cache: nothing expected, nothing counted
    assert caches.expected(same, pool.targets[0]) == 0
    asyncio.run(pool.close())


def test_prefix_affinity_when_loads_allow() -> None:
    def ledgers(running: int = 0, reserved: int = 0) -> list[Ledger]:
        return [Ledger(True, 100, 0, 0), Ledger(True, 100, reserved, running)]

    rr = RoundRobin()  # its pick is replica 0
    assert rr.route(ledgers(), 10, 8) == 0
    assert rr.route(ledgers(), 10, 8, (0, 64)) == 1  # where its prompt is cached
    assert rr.route(ledgers(), 10, 8, (64, 32)) == 0
    assert rr.route(ledgers(running=2), 10, 8, (0, 64)) == 1
    assert rr.route(ledgers(running=3), 10, 8, (0, 64)) == 0  # too busy: the balance matters more
    assert rr.route(ledgers(reserved=30), 10, 8, (0, 64)) == 0
    assert rr.route(ledgers(reserved=95), 10, 8, (0, 64)) == 0  # no room for it there


def _view(waiting: list[WaitingView], decoding: list[RequestView] | None = None, n: int = 2) -> SchedulerView:
    cost = PassCost(16, 5.8, [(t, 5.0 + 0.1 * t) for t in (1, 8, 16, 64, 128)])  # 5 ms + 0.1 ms per token
    reps = [ReplicaView(i, True, 1000, 0, sum(r.replica == i for r in decoding or []), cost) for i in range(n)]
    return SchedulerView(waiting, [], decoding or [], reps, DraftView(False, False), Limits(64, 256, 16, 16))


def test_fifo_admission_routes_to_the_cache_and_chunks_the_uncached_prompt() -> None:
    w = WaitingView("a", 100, 20, 10, "chat", 50.0, 1000.0, 0.0, cached=(0, 96))
    assert w.uncached(1) == 4 and w.uncached(0) == 100 and w.uncached(None) == 100
    plan = Scheduler(Policy(), RoundRobin()).plan(_view([w]), 1)
    assert [(a.rid, a.replica) for a in plan.admitted] == [("a", 1)] and plan.chunks == {"a": 4}


@pytest.mark.parametrize("cached", [0, 1984])
def test_slo_admission_prices_the_uncached_prompt(cached: int) -> None:
    """Beside a decoder on each replica, 2,000 prompt tokens cannot be in within a 150 ms TTFT (passes of 256
    at 30.6 ms); 16 can."""
    w = WaitingView("a", 2000, 20, 140, "chat", 10.0, 150.0, 0.0, cached=(0, cached))
    decoders = [RequestView(f"d{i}", "chat", 10.0, 1000.0, 5, 50.0, 100, [], i, 0) for i in range(2)]
    sched = Scheduler(Policy(), make_router("slo"), admission=SloAdmission())
    plan = sched.plan(_view([w], decoders), 1)
    if cached:
        assert [(a.rid, a.replica) for a in plan.admitted] == [("a", 1)] and plan.chunks == {"a": 16}
    else:
        assert plan.admitted == [] and "a" in plan.rejected
