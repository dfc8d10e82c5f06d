"""Where a service runs its model calls (shared/host/service_base.ServiceHost), over a real socket.

A small call that finds the model thread idle runs on the event loop's own thread (no hop there and
back); a large one runs on the model thread, and so does a small one that arrives while a call is
there, after it: calls never overlap and keep their arrival order. Health is answered while a
large call runs. The handlers here record where and when they ran; the sizes are the target
service's own `call_tokens`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from specserve.shared.host.service_base import ServiceHost
from specserve.shared.wire.messages import Forward, ForwardReply, Health, HealthReply, Message, VerifyEntry
from specserve.shared.wire.rpc import RpcClient, RpcServer
from specserve.target.server import call_tokens
from tests.support import poll

T = TypeVar("T")


def forward(nodes: int, rid: str = "r") -> Forward:
    return Forward([], [VerifyEntry(rid, 1, 10, nodes)])


class Recorder:
    """A Forward handler that records (rid, thread, start, end); rid "slow" blocks until released."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, str, float, float]] = []
        self.release = threading.Event()
        self.slow_started = threading.Event()

    def __call__(self, body: Message, _tensors: dict) -> tuple[ForwardReply, None]:
        assert isinstance(body, Forward)
        rid = body.verify.rids[0]
        t0 = time.monotonic()
        if rid == "slow":
            self.slow_started.set()
            assert self.release.wait(10)
        self.runs.append((rid, threading.current_thread().name, t0, time.monotonic()))
        return ForwardReply([], 0.0, 0.0, 0.0, 0), None


def host(recorder: Recorder, inline_tokens: int) -> ServiceHost:
    h = ServiceHost("target", "m", "cpu", "float32", {Forward: recorder}, lambda: Health(), call_tokens=call_tokens)
    h.inline_tokens = inline_tokens
    return h


def _now(probe: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    """A probe for poll.until_async from a plain function."""
    async def probe_now() -> T:
        return probe()
    return probe_now


async def serve(h: ServiceHost, path: str) -> tuple[RpcServer, str]:
    server = RpcServer(h.handle)
    return server, await server.start(f"unix:{path}")


def threads_of(tmp_path, inline_tokens: int, calls: list[tuple[int, str]]) -> dict[str, str]:
    """Forward calls of (tokens, rid), one after another over a real socket: rid -> the thread it ran on."""
    recorder = Recorder()
    h = host(recorder, inline_tokens=inline_tokens)

    async def main() -> None:
        server, address = await serve(h, str(tmp_path / "t.sock"))
        client = await RpcClient.connect(address)
        try:
            for tokens, rid in calls:
                await client.call(forward(tokens, rid), ForwardReply)
        finally:
            await client.close()
            await server.close()

    asyncio.run(main())
    h.executor.shutdown()
    return {rid: thread for rid, thread, _, _ in recorder.runs}


def test_small_calls_run_on_the_loop_thread_and_large_ones_on_the_model_thread(tmp_path):
    where = threads_of(tmp_path, 8, [(8, "small"), (9, "large")])
    assert where["small"] == "MainThread" and where["large"].startswith("target-model")


def test_zero_inline_tokens_sends_every_call_to_the_model_thread(tmp_path):
    assert threads_of(tmp_path, 0, [(1, "small")])["small"].startswith("target-model")


def test_a_small_call_waits_for_the_call_on_the_model_thread_and_health_does_not(tmp_path):
    recorder = Recorder()
    h = host(recorder, inline_tokens=8)

    async def main() -> None:
        server, address = await serve(h, str(tmp_path / "t.sock"))
        a, b, c = [await RpcClient.connect(address) for _ in range(3)]
        try:
            slow = asyncio.ensure_future(a.call(forward(64, "slow"), ForwardReply))
            await asyncio.get_running_loop().run_in_executor(None, recorder.slow_started.wait, 10)
            slow_call = h._last  # the slow call's place on the model thread
            small = asyncio.ensure_future(b.call(forward(1, "small"), ForwardReply))
            reply, _ = await asyncio.wait_for(c.call(Health(), HealthReply), 5)  # not behind the slow call
            assert reply.service == "target"
            # the host has taken the small call: queued behind the slow one, or (wrongly) run beside it
            await poll.until_async(_now(lambda: small.done() or h._last is not slow_call), 10,
                                   "the host to take the small call")
            assert not small.done()  # it waits for the slow call instead of running beside it
            recorder.release.set()
            await asyncio.wait_for(asyncio.gather(slow, small), 10)
        finally:
            for client in (a, b, c):
                await client.close()
            await server.close()

    asyncio.run(main())
    h.executor.shutdown()
    (first, first_thread, _, first_end), (second, second_thread, second_start, _) = recorder.runs
    assert (first, second) == ("slow", "small")
    assert second_start >= first_end and second_thread == first_thread  # in order, on the model thread
