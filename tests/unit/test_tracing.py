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

Here: the tests that start no process and open no socket; the others are in tests/service/test_tracing.py
and tests/stack/test_tracing.py.
"""

from __future__ import annotations

import msgspec

from specserve.shared.process import tracing
from specserve.shared.wire.messages import Health
from specserve.shared.wire.transport import encode_frame

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_off_builds_nothing():
    assert not tracing.ENABLED
    assert tracing.span("x") is tracing.span("y")  # one shared no-op context
    assert tracing.carrier() is None
    with tracing.server_call("Forward", {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}) as span:
        assert span is None
    header = encode_frame(1, Health())[1]
    assert b"trace" not in header and msgspec.msgpack.decode(header) == {"call_id": 1, "body": {"type": "Health"}}
    assert not tracing.configured({})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert not tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
