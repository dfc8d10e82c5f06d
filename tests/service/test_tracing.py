"""Tracing (shared/process/tracing.py, services/gateway/obs/spans.py): OpenTelemetry spans across the gateway,
the draft and the target.

- In process, with the SDK's InMemorySpanExporter: the trace context crosses a real RpcServer /
  RpcClient connection in the frame header and the service's span is the child of the caller's; a
  frame without the field (what a peer before it sends) is served, and the field is ignored by a
  peer that does not know it; off, nothing is built.
- Across the three processes: `specserve up` with OTEL_EXPORTER_OTLP_ENDPOINT pointing at an
  OTLP/HTTP receiver in this test (aiohttp on a free port). Each process runs its real
  BatchSpanProcessor and OTLP/HTTP exporter; the receiver decodes every ExportTraceServiceRequest
  with opentelemetry-proto and keeps the spans in memory. That is how one in-memory store sees the
  spans of three processes without a test-only exporter in the product: an InMemorySpanExporter
  inside a service could not be read from here. The tree of one streamed request (the official
  openai client, with an incoming W3C traceparent) is asserted on it.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_tracing.py and tests/stack/test_tracing.py.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from specserve.shared.process import tracing
from specserve.shared.wire.messages import Health, HealthReply, Message
from specserve.shared.wire.rpc import RpcClient, RpcServer
from specserve.shared.wire.transport import PREFIX, TensorMeta, encode_frame, read_frame
from tests.support import poll
from tests.support.fixtures import BUDGET_24, start_up
from tests.support.procs import Up

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "bench/results/sweep-full/profile.json"  # a measured profile: no profiling at start
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


# ---- in process ------------------------------------------------------------------------------------
@pytest.fixture
def in_memory():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider, "target")
    yield exporter
    tracing.shutdown()


class OldHeader(msgspec.Struct):
    """transport.Header as it was before the trace field (every field always encoded)."""

    call_id: int
    body: Message
    tensors: list[TensorMeta] = []


async def _serve_health() -> tuple[RpcServer, str]:
    async def handler(body: Message, _tensors: dict) -> tuple[Message, None]:
        assert isinstance(body, Health)
        return HealthReply("target", "ok", "m", "cpu", "float32", 0.0), None

    server = RpcServer(handler, secret=b"s" * 32)
    return server, await server.start("127.0.0.1:0")


def test_old_and_new_frames_both_ways(in_memory):
    """An old peer's frame (no trace field, tensors always present) is served, untraced; a frame with
    the field is traced as the child of its traceparent; an old decoder reads a new frame."""
    carrier = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    new = b"".join(bytes(b) for b in encode_frame(7, Health(), trace=carrier))
    old_header = msgspec.msgpack.encode(OldHeader(3, Health()))
    old = PREFIX.pack(b"SSF1", len(old_header), 0) + old_header
    decoded = msgspec.msgpack.decode(new[PREFIX.size:], type=OldHeader)  # a peer before the field
    assert (decoded.call_id, decoded.body) == (7, Health())

    async def run() -> list[tuple[int, Message]]:
        server, address = await _serve_health()
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(old + new)
        replies = [await asyncio.wait_for(read_frame(reader), 10) for _ in range(2)]
        writer.close()
        await server.close()
        return [(call_id, body) for call_id, body, _ in replies]

    replies = asyncio.run(run())
    assert [c for c, _ in replies] == [3, 7] and all(isinstance(b, HealthReply) for _, b in replies)
    spans = in_memory.get_finished_spans()
    assert [s.name for s in spans] == ["target/Health"]  # the old frame carried no context: not traced
    span = spans[0]
    assert span.kind is SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_ID
    assert span.attributes["rpc.method"] == "Health" and span.attributes["specserve.reply.service"] == "target"


def test_context_crosses_a_real_connection(in_memory):
    """RpcClient puts the current span's context in the frame; RpcServer's span is its child."""

    async def run() -> None:
        server, address = await _serve_health()
        client = await RpcClient.connect(address, secret=b"s" * 32)
        await client.call(Health(), HealthReply)  # no span is current: no context is sent
        with tracing.span("target/Health", SpanKind.CLIENT):
            await client.call(Health(), HealthReply)
        await client.close()
        await server.close()

    asyncio.run(run())
    spans = {(s.name, s.kind): s for s in in_memory.get_finished_spans()}
    assert len(in_memory.get_finished_spans()) == 2, [s.name for s in in_memory.get_finished_spans()]
    client, server = spans["target/Health", SpanKind.CLIENT], spans["target/Health", SpanKind.SERVER]
    assert server.context.trace_id == client.context.trace_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id


def test_a_sampled_out_trace_stays_out_in_the_service(in_memory):
    """A caller whose trace was not sampled (flags 00) sends that decision along: the service's span
    does not record either, and nothing is exported."""

    async def run() -> None:
        server, address = await _serve_health()
        client = await RpcClient.connect(address, secret=b"s" * 32)
        unsampled = tracing.extract({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})
        with tracing.tracer().start_as_current_span("target/Health", context=unsampled, kind=SpanKind.CLIENT) as s:
            assert not s.is_recording()
            assert tracing.carrier() == {"traceparent": f"00-{TRACE_ID}-{s.get_span_context().span_id:016x}-00"}
            await client.call(Health(), HealthReply)
        await client.close()
        await server.close()

    asyncio.run(run())
    assert in_memory.get_finished_spans() == ()


# ---- three processes ---------------------------------------------------------------------------------
@dataclass
class SpanData:
    service: str
    name: str
    kind: int  # the protobuf enum: 2 SERVER, 3 CLIENT, 1 INTERNAL
    trace_id: str
    span_id: str
    parent: str
    attrs: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    start_ns: int = 0
    end_ns: int = 0


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


class OtlpReceiver:
    """An OTLP/HTTP trace receiver (aiohttp, its own thread and loop): decodes each
    ExportTraceServiceRequest and keeps it, with the path and content type it came with."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str, ExportTraceServiceRequest]] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        ready.set()
        self.loop.run_forever()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        self.posts.append((request.path, request.content_type, message))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def spans(self) -> list[SpanData]:
        out = []
        for _, _, message in list(self.posts):
            for rs in message.resource_spans:
                service = {a.key: _value(a.value) for a in rs.resource.attributes}.get("service.name", "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(SpanData(service, s.name, s.kind, s.trace_id.hex(), s.span_id.hex(),
                                            s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                                            [(li.trace_id.hex(), li.span_id.hex()) for li in s.links],
                                            s.start_time_unix_nano, s.end_time_unix_nano))
        return out


def _traced(request, *gateway_args: str) -> tuple[Up, OtlpReceiver]:
    """`specserve up` (adaserve) exporting to an OtlpReceiver, and that receiver; both stopped when the
    fixture ends."""
    receiver = OtlpReceiver()
    request.addfinalizer(receiver.stop)
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}  # ms: export soon after a span ends
    for name in ("OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        env.pop(name, None)
    return start_up(request, "--policy", "adaserve", profile=PROFILE, gateway_args=(*BUDGET_24, *gateway_args),
                    env=env), receiver


def _wait_for(receiver: OtlpReceiver, done, timeout_s: float = 60) -> list[SpanData]:
    return poll.until(receiver.spans, timeout_s, "the spans the test looks for", ok=done, interval_s=0.2,
                      show=lambda spans: f"{len(spans)} spans: {sorted({(s.service, s.name) for s in spans})}")


@pytest.fixture(scope="module")
def traced_frontend_up(request):
    return _traced(request, "--frontends", "1")


def test_iterations_link_to_a_front_end_processes_request_span(traced_frontend_up):
    """With --frontends, the request span is the front end's (another process) and the engine's
    iterations, in the engine process, still link to it: the span context crosses the link."""
    up, receiver = traced_frontend_up
    c = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = c.completions.create(model="target", prompt="import os\nimport sys\n", max_tokens=12, temperature=0,
                               extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    steps = len(out.model_extra["specserve"]["steps"])

    def served(spans: list[SpanData]) -> tuple[SpanData | None, list[SpanData]]:
        req = next((s for s in spans if s.name == "llm_request" and s.attrs.get("gen_ai.request.id") == out.id), None)
        its = [] if req is None else [s for s in spans if s.name == "engine.iteration"
                                      and (req.trace_id, req.span_id) in s.links]
        return req, its

    spans = _wait_for(receiver, lambda s: len(served(s)[1]) == steps + 1)
    req, iterations = served(spans)
    assert req is not None, sorted({(s.service, s.name) for s in spans})
    assert (req.service, req.trace_id, req.parent) == ("specserve-gateway-frontend", TRACE_ID, PARENT_ID)
    assert {s.service for s in iterations} == {"specserve-gateway"}
    assert len(iterations) == steps + 1  # one prefill iteration, then its verify steps
