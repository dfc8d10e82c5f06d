"""Tracing (shared/process/tracing.py, services/gateway/obs/spans.py): OpenTelemetry spans across the gateway,
the draft and the target.

Here: the tests that open sockets in this process; the others are in tests/unit/test_tracing.py and
tests/stack/test_tracing.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from specserve.shared.process import tracing
from specserve.shared.wire.messages import Health, HealthReply, Message
from specserve.shared.wire.rpc import RpcClient, RpcServer
from specserve.shared.wire.transport import PREFIX, TensorMeta, encode_frame, read_frame

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
