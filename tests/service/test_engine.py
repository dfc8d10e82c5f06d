"""The engine in-process against real draft and target services: plans that move the draft (offload,
reload) and the eager draft sync stay lossless, and the IterationRecord says what happened.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_engine.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from specserve.gateway.sched.plan import Decision, Residency, SchedulerView
from specserve.gateway.sched.policy.fixed import Chain
from tests.support.engine import Steered, idle, serve


def test_offload_and_reload_planned_by_the_policy(services, prompts_and_reference):
    prompts, stops = prompts_and_reference
    policy = Steered({4: Residency.OFFLOAD, 8: Residency.RELOAD})
    out = asyncio.run(serve(policy, services, prompts, stops, sync=False))
    assert out == [ref for _, ref in prompts]
    recs = policy.records
    moves = [(i, r.draft.transition) for i, r in enumerate(recs) if r.draft.transition]
    assert [m for _, m in moves] == ["offload", "reload"], moves
    (off, _), (on, _) = moves
    assert all(r.draft.requests == 0 for r in recs[off:on]), "speculated while offloaded"
    assert any(r.draft.requests > 0 for r in recs[:off]) and any(r.draft.requests > 0 for r in recs[on:])
    assert any(r.draft.catchup_ms > 0 for r in recs[on:]), "no catch-up measured after the reload"
    asyncio.run(idle(services))


def test_eager_and_lazy_draft_sync_are_lossless(services, prompts_and_reference):
    prompts, stops = prompts_and_reference
    for sync in (False, True):
        policy = Steered(off_every=3)  # speculate on every third iteration only
        out = asyncio.run(serve(policy, services, prompts, stops, sync=sync))
        assert out == [ref for _, ref in prompts], sync
        synced = sum(r.draft.sync_requests for r in policy.records)
        assert (synced > 0) == sync, (sync, synced)
        for r in policy.records:  # the four parts of the split add up to the iteration
            parts = r.draft_ms + r.target_ms + r.transport_ms + r.schedule_ms
            assert parts == pytest.approx(r.total_ms, rel=1e-6, abs=1e-6)
        asyncio.run(idle(services))


class Withholding(Chain):
    """chain:3 that admits nobody for its first `hold` iterations: requests wait with nothing running
    (as the best-effort tier waits when SLO admission declines it). Past `spin` iterations it gives up
    holding, so a loop that never yields fails the test instead of hanging it."""

    def __init__(self, hold_s: float, spin: int = 2000):
        super().__init__(3)
        self.until, self.spin, self.calls = time.perf_counter() + hold_s, spin, 0

    def decide(self, view: SchedulerView) -> Decision:
        decision = super().decide(view)
        self.calls += 1
        if time.perf_counter() < self.until and self.calls < self.spin:
            decision.admit = []
        return decision


def test_waiting_requests_no_replica_takes_leave_the_event_loop_free(services, prompts_and_reference):
    prompts, stops = prompts_and_reference
    policy = Withholding(hold_s=1.0)
    ticks = 0

    async def clock() -> None:  # what an HTTP handler needs: the loop, now and then
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def run() -> list[list[int]]:
        task = asyncio.create_task(clock())
        try:
            return await serve(policy, services, prompts[:1], stops, sync=False)
        finally:
            task.cancel()

    out = asyncio.run(run())
    assert out == [prompts[0][1]]
    assert policy.calls < 200, f"{policy.calls} plans while nothing could run: the loop spun"
    assert ticks >= 50  # 1 s held: the other tasks ran all along
    asyncio.run(idle(services))
