"""The engine process's side of the front ends: a socket server (Unix, or TCP for front ends run on
their own), one connection per front end, each first authenticated with the shared secret.

A `Submit` becomes a `GenRequest` whose events, instead of waiting in a queue for an HTTP handler of
this process, go into its connection's outbox; one writer task per connection sends the outbox as
one `Events` frame per wake-up (every event since the last frame, so tokens of many requests and
iterations travel together when the front end reads slowly). A request refused at once (503) or
too large for every KV pool (400) is answered with its `FINISHED` event. When a connection ends (a
front end died or stopped), every request it submitted that is still running is aborted: the other
front ends' requests are not touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import msgspec

from specserve.gateway.engine.grammar import GrammarError, GrammarSpec, RequestGrammar
from specserve.gateway.engine.intake import ServiceUnavailable
from specserve.gateway.engine.request import Admitted, Event, Submission, Tokens
from specserve.gateway.frontend import wire
from specserve.gateway.frontend.local import LocalEngine, kv_pool_error
from specserve.gateway.obs import spans
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.wire.auth import ServerHandshake
from specserve.shared.wire.messages import AuthChallenge

log = logging.getLogger("specserve.gateway")


class _Connection:
    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.outbox: list[wire.Event] = []
        self.wake = asyncio.Event()
        self.rids: set[str] = set()  # its requests still running

    def emit(self, event: wire.Event) -> None:
        self.outbox.append(event)
        self.wake.set()

    def send(self, message: wire.ToFrontend) -> None:
        self.writer.write(wire.frame(message))

    async def flush_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            items, self.outbox = self.outbox, []
            self.send(wire.Events(items))
            await self.writer.drain()


class _Sink(asyncio.Queue):
    """A request's event queue that forwards every event to its front end's connection."""

    def __init__(self, connection: _Connection, rid: str):
        super().__init__()
        self.connection, self.rid = connection, rid

    def put_nowait(self, item: Event) -> None:
        rid = self.rid
        if isinstance(item, Tokens):
            self.connection.emit(wire.Event(rid, wire.TOKENS, item.tokens, logprobs=item.logprobs,
                                            prompt_logprobs=item.prompt_logprobs))
        elif isinstance(item, Admitted):
            self.connection.emit(wire.Event(rid, wire.ADMITTED, replica=item.replica))
        else:
            self.connection.rids.discard(rid)
            self.connection.emit(wire.Event(rid, wire.FINISHED, reason=item.reason, error=item.error,
                                            retry_after_s=item.retry_after_s,
                                            report=msgspec.json.encode(item.report) if item.report else b""))


class FrontendLink:
    def __init__(self, local: LocalEngine, secret: bytes):
        self.local = local
        self.secret = secret
        self.connections: set[_Connection] = set()
        self._compiling: set[asyncio.Future[None]] = set()  # grammars compiled before their requests are submitted

    async def start(self, address: str) -> asyncio.Server:
        """Serve front ends on "unix:/path" or "host:port"."""
        return await wire.serve_link(self._serve, address)

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The handshake (shared/wire/auth.py) within wire.HANDSHAKE_TIMEOUT_S; False: close the connection."""
        handshake = ServerHandshake(self.secret)
        try:
            async with asyncio.timeout(wire.HANDSHAKE_TIMEOUT_S):
                hello = await wire.read(reader, wire.auth_hello, wire.MAX_HANDSHAKE_BYTES)
                challenge = handshake.answer(hello)
                if not isinstance(challenge, AuthChallenge):
                    raise ConnectionError(str(challenge))
                writer.write(wire.frame(challenge))
                proof = await wire.read(reader, wire.auth_proof, wire.MAX_HANDSHAKE_BYTES)
                answer = handshake.answer(proof)
                if not handshake.authenticated:
                    raise ConnectionError(getattr(answer, "message", "unauthenticated"))
            return True
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError) as exc:
            peer = writer.get_extra_info("peername") or "a local socket"
            log.warning("a front end from %s was refused: %s", peer, exc or type(exc).__name__)
            return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await self._authenticate(reader, writer):
            writer.close()
            return
        conn = _Connection(writer)
        self.connections.add(conn)
        classes = {n: (c.tpot_ms, c.ttft_ms) for n, c in self.local.classes.items()}
        conn.send(wire.Hello(classes))
        flusher = asyncio.create_task(conn.flush_loop())
        try:
            while True:
                message = await wire.read(reader, wire.to_engine)
                if isinstance(message, wire.Submit):
                    self._submit(conn, message)
                elif isinstance(message, wire.Abort):
                    conn.rids.discard(message.rid)
                    self.local.abort(message.rid, message.reason)
                elif isinstance(message, wire.Count):
                    self.local.count_error(message.code)
                elif isinstance(message, wire.Query):
                    conn.send(await self._answer(message))
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError) or exc.partial:
                log.warning("a front end's connection failed: %s", exc)
        finally:
            self.connections.discard(conn)
            if conn.rids:
                log.warning("a front end went away: aborting its %d running requests", len(conn.rids))
            for rid in list(conn.rids):
                self.local.abort(rid)
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            writer.close()

    def _submit(self, conn: _Connection, m: wire.Submit, grammar: RequestGrammar | None = None) -> None:
        too_large = kv_pool_error(self.local, len(m.prompt), m.max_tokens)
        if too_large is not None:
            conn.emit(wire.Event(m.rid, wire.FINISHED, reason="invalid", error=too_large))
            return
        if m.grammar_kind and grammar is None:  # structured output: its grammar compiled here first
            self._compile_then_submit(conn, m)
            return
        # the iterations link to the front end's request span
        sub = Submission(m.rid, m.prompt, m.sampling, m.max_tokens, SloClass(m.tier, m.tpot_ms, m.ttft_ms),
                         frozenset(m.stop_ids), m.best_effort_ok, spans.from_wire(m.trace), grammar, m.final_only)
        try:
            self.local.submit(sub, _Sink(conn, m.rid))
        except ServiceUnavailable as exc:
            conn.emit(wire.Event(m.rid, wire.FINISHED, reason="rejected", error=str(exc),
                                 retry_after_s=exc.retry_after_s))
            return
        conn.rids.add(m.rid)

    def _compile_then_submit(self, conn: _Connection, m: wire.Submit) -> None:
        """A request with a grammar: from the engine's cache at once, else compiled off the event loop (the
        front end compiled it too, so a refusal here is a 400 only if the two differ); aborted meanwhile, it
        is not submitted."""
        grammars = self.local.grammars
        spec = GrammarSpec(m.grammar_kind, m.grammar_source, m.grammar_field)
        if grammars is None:
            conn.emit(wire.Event(m.rid, wire.FINISHED, reason="invalid", error="structured output is not served"))
            return
        hit = grammars.cached(spec)
        if hit is not None:
            self._submit(conn, m, hit)
            return
        conn.rids.add(m.rid)

        async def compile_then_submit() -> None:
            try:
                grammar = await grammars.compile_async(spec)
            except GrammarError as exc:
                grammar, error = None, f"invalid {exc.message}"
            if m.rid not in conn.rids or conn not in self.connections:  # aborted, or its front end is gone
                return
            conn.rids.discard(m.rid)
            if grammar is None:
                conn.emit(wire.Event(m.rid, wire.FINISHED, reason="invalid", error=error))
            else:
                self._submit(conn, m, grammar)

        task = asyncio.ensure_future(compile_then_submit())
        self._compiling.add(task)
        task.add_done_callback(self._compiling.discard)

    async def _answer(self, q: wire.Query) -> wire.Answer:
        if q.what == "health":
            status, body = await self.local.health()
            return wire.Answer(q.qid, status, json.dumps(body).encode())
        if q.what == "slo_classes":
            return wire.Answer(q.qid, 200, json.dumps(await self.local.slo_classes()).encode())
        if q.what == "metrics":
            return wire.Answer(q.qid, 200, (await self.local.metrics_text()).encode())
        return wire.Answer(q.qid, 404, b"{}")
