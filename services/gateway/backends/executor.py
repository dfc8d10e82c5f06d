"""The executor: every call the gateway makes to the draft and target services, each with a deadline.

Each call ends in one of three ways, and the caller is told which:
- a reply: the call ran (single entries may still carry their own error, which ends only that request);
- `Failure("remote", ...)`: the service is alive and answered the whole call with an error. It stays up;
- `Failure("down", ...)`: a transport failure (connection lost, unreadable reply, deadline exceeded).
  The connection is dropped and the service marked down; the pool reconnects it later.

Each replica's step loop calls its own target pass (and beside it, with the eager draft sync, a
depth-0 Speculate call that keeps the draft's view of committed tokens current). The draft serves
every replica: `speculate` queues a replica's entries, and one call carries the entries of every
replica that is ready in the same turn of the event loop, or while the previous call runs (the
draft answers one call at a time). With a draft window of w ms, the call also waits up to w ms after
its first entry for the other replicas that have requests (`expected`), and goes as soon as every one
of them has queued: a replica that is not ready costs the others at most w.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specserve.gateway.backends.pool import DraftService, ServicePool, TargetReplica
from specserve.gateway.sched.plan import Residency
from specserve.shared.process import tracing
from specserve.shared.wire.messages import ForwardReply, SpeculateReply, TransitionReply
from specserve.shared.wire.rpc import TRANSPORT_ERRORS, RemoteError, RpcProtocolError
from specserve.shared.wire.service_client import Candidate, PrefillItem, SpeculateItem, StepOutput, VerifyItem
from specserve.shared.wire.transport import MessageError

log = logging.getLogger("specserve.gateway")
T = TypeVar("T")
PING_TIMEOUT_S = 2.0  # an idle service must answer Health within this


@dataclass(slots=True)
class Failure:
    kind: str  # "remote": the service refused the call; "down": transport failure, the service is marked down
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(slots=True)
class CallResult(Generic[T]):
    value: T | None
    failure: Failure | None
    ms: float  # the call as the gateway saw it


SpeculateResult = CallResult[tuple[list[Candidate], SpeculateReply]]


@dataclass(slots=True)
class TargetPass:
    replica: TargetReplica
    prefill: list[PrefillItem]
    verify: list[VerifyItem]
    features: bool = False  # return the target's features (the draft reads them)
    release: list[str] = field(default_factory=list)  # the releases it owes, freed before the pass (Forward.release)


class Executor:
    def __init__(self, pool: ServicePool, call_timeout_s: float, draft_window_ms: float = 0.0,
                 expected: Callable[[], int] | None = None):
        self.pool = pool
        self.call_timeout_s = call_timeout_s  # deadline of every service call, seconds
        self.draft_window_s = draft_window_ms / 1e3  # a draft call waits this long for the other replicas
        self.expected = expected or (lambda: sum(t.up for t in pool.targets))  # replicas that may join a call
        self._queued: list[tuple[int, list[SpeculateItem], asyncio.Future[SpeculateResult]]] = []
        self._all_queued = asyncio.Event()  # every expected replica has entries in the queue
        self._sender: asyncio.Task[None] | None = None
        self._releasing: dict[str, asyncio.Lock] = {}  # per service address: one release call at a time

    async def _guard(self, service: TargetReplica | DraftService, call: Callable[[], Awaitable[T]],
                     timeout_s: float | None = None, span: str | None = None) -> CallResult[T]:
        """span: trace this call as a CLIENT span of that name (when tracing is on); its context goes
        in the frame header, and the service's own span is its child."""
        if span is not None and tracing.ENABLED:
            with tracing.span(span, tracing.SpanKind.CLIENT) as current:
                result = await self._call(service, call, timeout_s)
                if current.is_recording():
                    current.set_attributes(call_attributes(service, result))
                if result.failure is not None:
                    tracing.failed(current, str(result.failure))
                return result
        return await self._call(service, call, timeout_s)

    async def _call(self, service: TargetReplica | DraftService, call: Callable[[], Awaitable[T]],
                    timeout_s: float | None) -> CallResult[T]:
        t0 = time.perf_counter()
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                value = await call()
            service.last_ok = time.monotonic()
            return CallResult(value, None, (time.perf_counter() - t0) * 1e3)
        except TRANSPORT_ERRORS as exc:  # first: a reply out of step is a protocol error *and* transport
            reason = f"no reply within {timeout_s:g} s" if isinstance(exc, TimeoutError) else \
                f"{type(exc).__name__}: {exc}"
            failure = Failure("down", reason)
            await service.mark_down()
        except (RemoteError, RpcProtocolError, MessageError) as exc:  # answered, in step: the service is alive
            service.last_ok = time.monotonic()
            failure = Failure("remote", str(exc))
        return CallResult(None, failure, (time.perf_counter() - t0) * 1e3)

    # ---- releases --------------------------------------------------------------------------------
    async def release_owed(self, replica: TargetReplica | None = None, target: bool = True) -> None:
        """Send the releases owed to one replica and to the draft (None: to every up service); what
        fails stays owed. target=False: the draft's alone (the replica's go with its next pass)."""
        targets = [] if not target else self.pool.targets if replica is None else [replica]
        services: list[TargetReplica | DraftService] = [t for t in targets if t.up and t.owed_releases]
        draft = self.pool.draft
        if draft is not None and draft.up and draft.owed_releases:
            services.append(draft)
        if services:
            await asyncio.gather(*(self._release(s) for s in services))

    async def _release(self, s: TargetReplica | DraftService) -> None:
        """One service's releases; one call at a time per service, so a second loop sends only what the
        first did not (a release is never sent after that request's next entry)."""
        async with self._releasing.setdefault(s.address, asyncio.Lock()):
            rids = sorted(s.owed_releases)
            client = s.client
            if not rids or client is None:
                return
            result = await self._guard(s, lambda: client.release(rids))
            if result.value is not None:
                s.owed_releases.difference_update(rids)
                if isinstance(s, TargetReplica):
                    s.free_blocks = result.value.free_blocks
            else:
                log.warning("release at %s failed (%s); kept for the next iteration", s.address, result.failure)

    async def ping(self) -> None:
        """Health to every up service (while idle): one that does not answer is marked down."""
        services: list[TargetReplica | DraftService] = [t for t in self.pool.targets if t.up]
        if self.pool.draft is not None and self.pool.draft.up:
            services.append(self.pool.draft)

        async def one(s: TargetReplica | DraftService) -> None:
            client = s.client
            assert client is not None
            await self._guard(s, client.health, PING_TIMEOUT_S)  # Health is answered without the model

        await asyncio.gather(*(one(s) for s in services))

    # ---- the draft -------------------------------------------------------------------------------
    async def transition(self, residency: Residency) -> CallResult[TransitionReply]:
        draft = self.pool.draft
        assert draft is not None and draft.client is not None
        client = draft.client
        call = client.offload if residency is Residency.OFFLOAD else client.reload
        result = await self._guard(draft, call, span="draft/Offload" if residency is Residency.OFFLOAD
                                   else "draft/Reload")
        if result.value is not None:
            draft.offloaded = result.value.offloaded
        return result

    async def speculate(self, items: list[SpeculateItem], replica: int = 0) -> SpeculateResult:
        """One replica's entries, sent with the entries of the other replicas that are ready now (or
        within the draft window); the reply holds this caller's candidates (and the whole call's times
        and failure)."""
        if sum(t.up for t in self.pool.targets) <= 1:
            return await self._speculate_now(items)  # nobody to batch with: no turn of the event loop lost
        future: asyncio.Future[SpeculateResult] = asyncio.get_running_loop().create_future()
        self._queued.append((replica, items, future))
        if len({i for i, _, _ in self._queued}) >= self.expected():
            self._all_queued.set()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send_queued())
        return await future

    async def _send_queued(self) -> None:
        while self._queued:
            await asyncio.sleep(0)  # the replicas that are ready in this turn join the call
            if self.draft_window_s > 0 and not self._all_queued.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_queued.wait(), self.draft_window_s)
            self._all_queued.clear()
            batch, self._queued = self._queued, []
            result = await self._speculate_now([item for _, items, _ in batch for item in items])
            for _, items, future in batch:
                if future.done():  # its loop was cancelled
                    continue
                if result.value is None or len(batch) == 1:
                    future.set_result(result)
                    continue
                rids = {item.rid for item in items}
                mine = [c for c in result.value[0] if c.rid in rids]
                future.set_result(CallResult((mine, result.value[1]), None, result.ms))

    async def _speculate_now(self, items: list[SpeculateItem]) -> SpeculateResult:
        draft = self.pool.draft
        assert draft is not None
        client = draft.client
        if client is None:  # it went down while these entries were queued
            return CallResult(None, Failure("down", "the draft service is down"), 0.0)
        result = await self._guard(draft, lambda: client.speculate(items), span="draft/Speculate")
        if result.value is not None and result.value[1].offloaded:
            draft.offloaded = True  # offloaded by someone else, or restarted offloaded
        return result

    # ---- the target pass -------------------------------------------------------------------------
    async def target_pass(self, passes: list[TargetPass], sync: list[SpeculateItem]) -> tuple[
            list[CallResult[tuple[list[StepOutput], ForwardReply]]],
            CallResult[tuple[list[Candidate], SpeculateReply]] | None, float]:
        """Every replica's Forward at once (and the eager draft sync beside them); the wall time, ms."""
        t0 = time.perf_counter()

        def forward(p: TargetPass) -> Callable[[], Awaitable[tuple[list[StepOutput], ForwardReply]]]:
            client = p.replica.client
            assert client is not None
            return lambda: client.forward(p.prefill, p.verify, p.features, p.release)

        # The first replica's call is awaited directly, so its frame is written now; the others (and the
        # eager sync) are tasks, which start at the next turn of the event loop. Wrapping the first in a
        # task too would let every ready SSE handler run before the Forward is even sent, instead of
        # while the target computes.
        others = [asyncio.ensure_future(self._guard(p.replica, forward(p), span="target/Forward"))
                  for p in passes[1:]]
        sync_call = asyncio.ensure_future(self.speculate(sync, passes[0].replica.index if passes else 0)) \
            if sync else None
        results = [await self._guard(passes[0].replica, forward(passes[0]), span="target/Forward")] if passes else []
        results += [await task for task in others]
        synced = await sync_call if sync_call is not None else None
        return results, synced, (time.perf_counter() - t0) * 1e3


def call_attributes(service: TargetReplica | DraftService, result: CallResult) -> dict[str, str | int | float]:
    """A traced call's attributes: the peer, the replica, the time as the gateway saw it."""
    out: dict[str, str | int | float] = {"rpc.system": "specserve", "server.address": service.address,
                                         "specserve.call_ms": round(result.ms, 3)}
    if isinstance(service, TargetReplica):
        out["specserve.replica"] = service.index
    if result.failure is not None:
        out["specserve.failure"] = result.failure.kind
    return out
