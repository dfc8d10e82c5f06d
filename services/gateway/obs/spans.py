"""The gateway's spans: one per HTTP request, one per engine iteration (shared/process/tracing.py sets up and
propagates; nothing here runs while tracing is off).

- `llm_request` (SERVER), one per POST, continuing an incoming W3C `traceparent`. Its attributes are
  vLLM's `gen_ai.*` names (request id, model, sampling, usage, queue time, TTFT, end-to-end latency,
  in seconds as vLLM gives them) plus specserve's own (`specserve.*`: SLO tier and its TPOT / TTFT
  targets, the measured TPOT, tokens per verify step, replica, finish reason).
- `engine.iteration` (INTERNAL), the root of its own trace: an iteration serves many requests and a
  span has one parent, so it carries a *link* to each request span it served (OpenTelemetry's rule
  for batch work; vLLM's journey tracing links its engine-core span to `llm_request` the same way).
  Children: `draft/Speculate`, `policy.select`, `target/Forward` per replica (and `draft/Offload` /
  `draft/Reload`). Its attributes come from the IterationRecord: batch composition and time split.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import trace

from specserve.gateway.perf.record import IterationRecord
from specserve.shared.process import tracing

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler, Middleware


# The aiohttp request key under which a handler leaves a callable that gives the request span's
# attributes once the response is done (http/api.py: Generation.span_attributes).
ATTRIBUTES = "specserve.span_attributes"


# ---- the HTTP request ----------------------------------------------------------------------------
def middlewares(model: str) -> list[Middleware]:
    """The request-span middleware (outermost), or none while tracing is off."""
    if not tracing.ENABLED:
        return []

    @web.middleware
    async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST":  # health checks and scrapes are not traced
            return await handler(request)
        attributes = {"http.request.method": request.method, "url.path": request.path,
                      "gen_ai.system": "specserve", "gen_ai.response.model": model}
        with tracing.tracer().start_as_current_span("llm_request", context=tracing.extract(request.headers),
                                                    kind=trace.SpanKind.SERVER, attributes=attributes) as span:
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            finally:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    tracing.failed(span, f"HTTP {status}")
                span_attributes = request.get(ATTRIBUTES)
                if span_attributes is not None and span.is_recording():  # a span the sampler dropped keeps nothing
                    span.set_attributes(span_attributes())

    return [traced]


def current() -> trace.SpanContext | None:
    """The current span's context (the request span, when the handler submits), to link iterations to."""
    ctx = trace.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None


def to_wire(ctx: trace.SpanContext | None) -> bytes:
    """A span context as 25 bytes (trace id, span id, flags), for the front-end link; b"": none."""
    if ctx is None:
        return b""
    return ctx.trace_id.to_bytes(16, "big") + ctx.span_id.to_bytes(8, "big") + bytes([int(ctx.trace_flags)])


def from_wire(data: bytes) -> trace.SpanContext | None:
    """The span context `to_wire` wrote (a remote one: a front end's request span)."""
    if len(data) != 25:
        return None
    return trace.SpanContext(int.from_bytes(data[:16], "big"), int.from_bytes(data[16:24], "big"), is_remote=True,
                             trace_flags=trace.TraceFlags(data[24]))


# ---- the engine iteration ------------------------------------------------------------------------
@contextlib.contextmanager
def iteration(step: int, t0: float) -> Iterator[trace.Span]:
    """The iteration's span, a new trace, started at t0 (perf_counter) so that it covers what the
    record's total_ms covers."""
    start = time.time_ns() - int((time.perf_counter() - t0) * 1e9)
    with tracing.tracer().start_as_current_span("engine.iteration", context=otel_context.Context(),
                                                start_time=start, attributes={"specserve.step": step}) as span:
        yield span


def record_iteration(span: trace.Span, record: IterationRecord,
                     traces: Mapping[str, trace.SpanContext]) -> None:
    """The record's composition and time split on the span, and a link to each request span served."""
    if not span.is_recording():  # the sampler dropped it: nothing would be kept
        return
    span.set_attributes(iteration_attributes(record))
    for step in record.requests:
        ctx = traces.get(step.rid)
        if ctx is not None:
            span.add_link(ctx, {"gen_ai.request.id": step.rid})


def iteration_attributes(record: IterationRecord) -> dict[str, Any]:
    verify = record.verify_steps
    out: dict[str, Any] = {
        "specserve.batch_size": len(record.requests),
        "specserve.decode_requests": len(verify),
        "specserve.prefill_tokens": record.prefill_tokens,
        "specserve.tree_nodes": record.tree_nodes,
        "specserve.accepted_tokens": sum(s.accepted for s in verify),
        "specserve.emitted_tokens": sum(s.emitted for s in record.requests),
        "specserve.admitted": record.admitted,
        "specserve.deferred": record.deferred,
        "specserve.rejected": record.rejected,
        "specserve.waiting": record.waiting,
        "specserve.running": record.running,
        "specserve.replicas": len(record.replicas),
        "specserve.total_ms": record.total_ms,
        "specserve.draft_ms": record.draft_ms,
        "specserve.target_ms": record.target_ms,
        "specserve.transport_ms": record.transport_ms,
        "specserve.schedule_ms": record.schedule_ms,
        "specserve.draft.requests": record.draft.requests,
        "specserve.draft.catchup_ms": record.draft.catchup_ms,
        "specserve.draft.beam_ms": record.draft.beam_ms,
    }
    if record.draft.sync_requests:
        out["specserve.draft.sync_requests"] = record.draft.sync_requests
    if record.draft.transition is not None:
        out["specserve.draft.transition"] = record.draft.transition
    failures = [r.failure for r in record.replicas if r.failure] + ([record.draft.failure] if record.draft.failure
                                                                    else [])
    if failures:
        out["specserve.failures"] = failures
    return out
