"""A front end's side: `RemoteEngine`, the engine as the HTTP handlers of a front-end process see it.

It keeps one connection to the engine process. `submit` sends the tokenized request and keeps the
handler's event queue by id; a reader task hands each `Events` frame's events to their requests'
queues (so a handler sees `Admitted`, `Tokens` and `Finished` as it would beside the engine), and
each `Answer` to the query waiting for it. When the connection ends, every request still running
ends with an error, and so does every later submit, until the process is stopped (the engine
process restarts front ends, and a front end dies with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from specserve.gateway.engine.intake import ServiceUnavailable
from specserve.gateway.engine.request import Admitted, Event, Finished, Submission, Tokens
from specserve.gateway.frontend import wire
from specserve.gateway.obs import spans
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.process import tracing
from specserve.shared.process.loop_tasks import LoopTasks
from specserve.shared.wire.auth import AuthError, ClientHandshake

log = logging.getLogger("specserve.gateway")
ENGINE_GONE = "the engine process is gone"


class RemoteEngine:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, classes: dict[str, SloClass]):
        self.reader, self.writer, self.classes = reader, writer, classes
        self.requests: dict[str, asyncio.Queue[Event]] = {}  # by rid, until its Finished arrives
        self._answers: dict[int, asyncio.Future[wire.Answer]] = {}
        self._qids = itertools.count()
        self.closed = asyncio.Event()
        self._reader_task = asyncio.create_task(self._read())
        self._own = CollectorRegistry(auto_describe=False)  # this process's gauges, after the engine's metrics
        self._own.register(LoopTasks("specserve:frontend_asyncio_tasks", "Tasks alive on a front-end process's "
                                     "event loop.", {"pid": str(os.getpid())}, asyncio.get_running_loop()))

    @classmethod
    async def connect(cls, address: str, secret: bytes) -> RemoteEngine:
        """Connect to the engine's link ("unix:/path" or "host:port") and authenticate (AuthError: the
        secrets differ; ConnectionError / OSError: no engine there, or it closed the connection)."""
        reader, writer = await wire.open_link(address)
        try:
            async with asyncio.timeout(wire.HANDSHAKE_TIMEOUT_S):  # (TimeoutError is an OSError: tried again)
                handshake = ClientHandshake(secret)
                writer.write(wire.frame(handshake.hello()))
                writer.write(wire.frame(handshake.prove(await wire.read(reader, wire.auth_challenge))))
                hello = await wire.read(reader, wire.to_frontend)
                if not isinstance(hello, wire.Hello):
                    raise ConnectionError(f"the engine said {type(hello).__name__}, not Hello")
        except (asyncio.IncompleteReadError, msgspec.DecodeError) as exc:
            writer.close()
            raise ConnectionError(f"the engine closed the connection or answered out of turn during the "
                                  f"handshake ({type(exc).__name__})") from None
        except BaseException:
            writer.close()
            raise
        classes = {n: SloClass(n, tpot, ttft) for n, (tpot, ttft) in hello.classes.items()}
        return cls(reader, writer, classes)

    @classmethod
    async def connect_retrying(cls, address: str, secret: bytes, timeout_s: float) -> RemoteEngine:
        """`connect`, tried every second until timeout_s while nothing listens there yet (a front end
        started before its engine); a wrong secret fails at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await cls.connect(address, secret)
            except AuthError:
                raise
            except (ConnectionError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"no engine at {address} within {timeout_s:g} s: {exc}") from None
                log.info("waiting for the engine at %s (%s)", address, exc)
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task
        self.writer.close()

    # ---- EngineApi --------------------------------------------------------------------------------
    def submit(self, sub: Submission) -> asyncio.Queue[Event]:
        if self.closed.is_set():
            raise ServiceUnavailable(ENGINE_GONE, 1.0)
        events: asyncio.Queue[Event] = asyncio.Queue()
        self.requests[sub.rid] = events
        spec = sub.grammar.spec if sub.grammar is not None else None
        self._send(wire.Submit(sub.rid, sub.prompt, sub.sampling, sub.max_tokens, sub.slo.name, sub.slo.tpot_ms,
                               sub.slo.ttft_ms, sorted(sub.stop_ids), sub.best_effort_ok,
                               spans.to_wire(spans.current()) if tracing.ENABLED else b"",
                               *((spec.kind, spec.source, spec.field) if spec is not None else ("", "", "")),
                               final_only=sub.final_only))
        return events

    def abort(self, rid: str, reason: str = "abort") -> None:
        if rid in self.requests:  # (its Finished, with its report, still comes)
            self._send(wire.Abort(rid, reason))

    def count_error(self, code: str) -> None:
        self._send(wire.Count(code))

    def pool_tokens_short(self, prompt_tokens: int, max_tokens: int) -> int | None:
        return None  # the engine process checks it on submit (a 400 comes back as a FINISHED "invalid")

    async def health(self) -> tuple[int, dict]:
        answer = await self._query("health")
        return answer.status, json.loads(answer.body)

    async def slo_classes(self) -> dict:
        body: dict = json.loads((await self._query("slo_classes")).body)
        return body

    async def metrics_text(self) -> str:
        """The engine's metrics, then this front end's own (its pid labels them)."""
        return (await self._query("metrics")).body.decode() + generate_latest(self._own).decode()

    # ---- the connection ---------------------------------------------------------------------------
    def _send(self, message: wire.ToEngine) -> None:
        if not self.closed.is_set():
            self.writer.write(wire.frame(message))

    async def _query(self, what: str) -> wire.Answer:
        if self.closed.is_set():
            raise ServiceUnavailable(ENGINE_GONE, 1.0)
        qid = next(self._qids)
        future: asyncio.Future[wire.Answer] = asyncio.get_running_loop().create_future()
        self._answers[qid] = future
        self._send(wire.Query(qid, what))
        try:
            return await future
        finally:
            self._answers.pop(qid, None)

    async def _read(self) -> None:
        try:
            while True:
                message = await wire.read(self.reader, wire.to_frontend)
                if isinstance(message, wire.Events):
                    for event in message.items:
                        self._deliver(event)
                elif isinstance(message, wire.Answer):
                    future = self._answers.get(message.qid)
                    if future is not None and not future.done():
                        future.set_result(message)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError) as exc:
            log.error("the connection to the engine process ended (%s): its requests end", exc)
        finally:
            self.closed.set()
            for events in self.requests.values():
                events.put_nowait(Finished("error", ENGINE_GONE))
            self.requests.clear()
            for future in self._answers.values():
                if not future.done():
                    future.set_exception(ServiceUnavailable(ENGINE_GONE, 1.0))

    def _deliver(self, event: wire.Event) -> None:
        events = self.requests.get(event.rid)
        if events is None:
            return
        if event.kind == wire.TOKENS:
            events.put_nowait(Tokens(event.tokens, event.logprobs, event.prompt_logprobs))
        elif event.kind == wire.ADMITTED:
            events.put_nowait(Admitted(event.replica))
        else:
            del self.requests[event.rid]
            events.put_nowait(Finished(event.reason, event.error, event.retry_after_s,
                                       json.loads(event.report) if event.report else None))
