"""Two target replicas behind one gateway: `specserve up --targets 2` as real processes, the openai client.

- greedy output equals transformers', with the requests spread over both replicas;
- each replica steps on its own: with one replica frozen mid-pass (SIGSTOP), the other finishes its
  requests, and the frozen one's finish exactly once it runs again;
- killing one replica ends only its own requests with an error; the other keeps serving and takes
  new requests; `up` restarts the killed one and it rejoins (new requests reach it again);
- an error on one entry (a stranger released a request on its replica) ends that request alone;
- a poison request on one replica leaves every other request and both replicas untouched;
- the executor tells a remote error from a dead service and from a missed deadline (real target);
- the draft window: two replicas' `Speculate` entries go in one call when the window holds the
  first until the second is ready, in two calls without it (real draft).

The fault tests wait on what /health reports (requests running per replica, a replica ready), never
on fixed sleeps; the loop that ran them 20 times in a row on one core beside a busy loop is in
test_gateway_hardening.py's docstring.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/stack/test_replicas.py.
"""

from __future__ import annotations

import asyncio
import json
import time

from specserve.gateway.backends.executor import Executor
from specserve.gateway.backends.pool import DraftService, ServicePool, TargetReplica
from specserve.gateway.perf.cost import PassCost
from specserve.shared.host.launch import ServiceProcess, free_port
from specserve.shared.wire.service_client import PrefillItem, SpeculateItem, TargetClient


def test_executor_tells_remote_errors_from_dead_services_and_deadlines():
    target = ServiceProcess("target", threads=1)
    try:
        async def run():
            replica = TargetReplica(0, target.address, PassCost(8, 10.0))
            dead = TargetReplica(1, f"127.0.0.1:{free_port()}", PassCost(8, 10.0))
            pool = ServicePool([replica, dead], None)
            await replica.connect()
            executor = Executor(pool, call_timeout_s=30)

            async def bad_call():  # counts that disagree with the payload: the service refuses the call
                from specserve.shared.wire.messages import Forward, ForwardReply, PrefillEntry
                return await replica.client.rpc.call(Forward([PrefillEntry("x", 1, 0, 5, True)]), ForwardReply)

            remote = await executor._guard(replica, bad_call)
            assert remote.failure is not None and remote.failure.kind == "remote" and replica.up
            dead.client = await TargetClient.connect(target.address)  # then point it at nothing
            await dead.client.close()
            down = await executor._guard(dead, lambda: dead.client.stats())
            assert down.failure is not None and down.failure.kind == "down" and not dead.up
            slow = Executor(pool, call_timeout_s=0.0005)
            item = PrefillItem("y", 1, 0, list(range(1, 300)), True, None)
            from specserve.shared.wire.messages import SamplingSpec
            item.sampling = SamplingSpec()
            late = await slow._guard(replica, lambda: replica.client.forward([item], []))
            assert late.failure is not None and late.failure.kind == "down" and "no reply within" in str(late.failure)
            assert not replica.up  # the connection is dropped: its reply may still be in flight
            await replica.connect()  # and it reconnects
            assert replica.up
            assert json.dumps(replica.view().up)
            await pool.close()

        asyncio.run(run())
    finally:
        target.stop()


def watch_draft_calls(executor: Executor) -> tuple[asyncio.Event, asyncio.Event]:
    """(sent, held): set when the executor sends a draft call, and when its sender waits in the draft
    window for the other replicas."""
    sent, held = asyncio.Event(), asyncio.Event()
    speculate_now = executor._speculate_now

    async def sending(items):
        sent.set()
        return await speculate_now(items)

    class Held(asyncio.Event):
        async def wait(self):
            held.set()
            return await super().wait()

    executor._speculate_now = sending
    executor._all_queued = Held()
    return sent, held


def test_the_draft_window_batches_a_replica_that_comes_later():
    """Replica 1's entries are queued a few event-loop turns after replica 0's. With a window that
    waits for both replicas, one draft call serves both (the same reply), and it goes as soon as the
    second has queued, not when the window ends; with no window, replica 0's call has left, and
    replica 1's goes in a call of its own."""
    target, draft = ServiceProcess("target", threads=1), ServiceProcess("draft", threads=1)
    try:
        async def run(window_ms: float) -> tuple[bool, float]:
            pool = ServicePool([TargetReplica(i, target.address, PassCost(8, 10.0)) for i in (0, 1)],
                               DraftService(draft.address))
            await pool.connect_all()
            executor = Executor(pool, call_timeout_s=30, draft_window_ms=window_ms, expected=lambda: 2)
            prompt = list(range(5, 25))

            def entry(rid: str) -> list[SpeculateItem]:
                return [SpeculateItem(rid, 1, prompt, len(prompt), depth=2, width=1)]

            sent, held = watch_draft_calls(executor)
            t0 = time.perf_counter()
            first = asyncio.ensure_future(executor.speculate(entry(f"a{window_ms}"), 0))
            # replica 0's entries are past the same-turn join: sent in a call of their own, or held by the window
            done, pending = await asyncio.wait([asyncio.ensure_future(e.wait()) for e in (sent, held)], timeout=10,
                                               return_when=asyncio.FIRST_COMPLETED)
            for waiter in pending:
                waiter.cancel()
            assert done, "replica 0's entries were neither sent nor held by the window within 10 s"
            assert held.is_set() == (window_ms > 0) and sent.is_set() == (window_ms == 0), (held, sent)
            second = await executor.speculate(entry(f"b{window_ms}"), 1)
            first_result = await first
            assert first_result.value is not None and second.value is not None
            assert [c.rid for c in first_result.value[0]] == [f"a{window_ms}"]  # each gets its own candidates
            assert [c.rid for c in second.value[0]] == [f"b{window_ms}"]
            await pool.close()
            return first_result.value[1] is second.value[1], time.perf_counter() - t0

        one_call, waited_s = asyncio.run(run(60_000.0))
        assert one_call and waited_s < 30  # it went when replica 1 queued, not after the 60 s window
        one_call, _ = asyncio.run(run(0.0))
        assert not one_call
    finally:
        target.stop()
        draft.stop()
