"""OpenTelemetry tracing: setup from the standard OTEL_* variables, the no-op path, and the trace
context that travels in a frame header.

Off unless OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set (and
OTEL_SDK_DISABLED is not "true"). Off, `ENABLED` is False and callers test it once before doing
anything for a trace: no tracer, no span objects, no attribute dicts, no header field.

On, one TracerProvider per process, configured by the SDK from the standard variables:
- the sampler: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default parentbased_always_on, so a
  service follows the gateway's decision carried in `traceparent`);
- the resource: OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES (service.name defaults to
  specserve-<service>);
- a BatchSpanProcessor (OTEL_BSP_*: queue, batch size, delay) in front of the OTLP/HTTP protobuf
  exporter (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT / _HEADERS / _TIMEOUT / _COMPRESSION);
- the propagator: OTEL_PROPAGATORS (default W3C tracecontext and baggage).

Between the gateway and the services the context travels as an optional `trace` field of the
frame header (transport.Header): the W3C carrier (`traceparent`, `tracestate`) of the gateway's
call span. A service opens a SERVER span as its child for each call that carries one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("specserve.tracing")

ENABLED = False  # the one boolean every hot path tests
SERVICE = ""  # "gateway", "draft" or "target" once set up
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None
_NOOP: contextlib.nullcontext[None] = contextlib.nullcontext()  # reusable: entering it allocates nothing

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def configured(env: Mapping[str, str] = os.environ) -> bool:
    """An OTLP endpoint is set and the SDK is not disabled."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def setup(service: str) -> bool:
    """Turn tracing on for this process if the environment asks for it; True if on."""
    if ENABLED:
        return True
    if not configured():
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME; attributes passed here win,
    # so the default name is only passed when the operator named none.
    named = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    resource = Resource.create({} if named else {SERVICE_NAME: f"specserve-{service}"})
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER(_ARG)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    install(provider, service)
    log.info("tracing on: OTLP/HTTP to %s", next(os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)))
    return True


def install(provider: TracerProvider, service: str) -> None:
    """Use this provider (setup's, or a test's with an in-memory exporter)."""
    global ENABLED, SERVICE, _tracer, _provider
    _provider, SERVICE = provider, service
    _tracer = provider.get_tracer("specserve")
    ENABLED = True


def shutdown() -> None:
    """Export what is buffered and turn tracing off (at process exit)."""
    global ENABLED, _tracer, _provider
    provider, _provider, _tracer, ENABLED = _provider, None, None, False
    if provider is not None:
        provider.shutdown()


def tracer() -> trace.Tracer:
    assert _tracer is not None, "tracing is off"
    return _tracer


# ---- spans ---------------------------------------------------------------------------------------
def span(name: str, kind: SpanKind = SpanKind.INTERNAL) -> contextlib.AbstractContextManager[Any]:
    """A child of the current span, current while the block runs; a shared no-op when off."""
    if not ENABLED:
        return _NOOP
    return tracer().start_as_current_span(name, kind=kind)


def failed(current: trace.Span, message: str) -> None:
    current.set_status(Status(StatusCode.ERROR, message))


def struct_attributes(prefix: str, message: msgspec.Struct) -> dict[str, Any]:
    """A message's scalar fields as attributes (`prefix.field`); a list field, or one of entries by column
    (`VerifyColumns`, `ResultColumns`), as its length."""
    out: dict[str, Any] = {}
    for name in message.__struct_fields__:
        value = getattr(message, name)
        if isinstance(value, (bool, int, float, str)):
            out[f"{prefix}.{name}"] = value
        elif isinstance(value, list) or isinstance(value, msgspec.Struct) and isinstance(value, Sized):
            out[f"{prefix}.{name}.count"] = len(value)
    return out


# ---- context propagation ---------------------------------------------------------------------------
def carrier() -> dict[str, str] | None:
    """The current span's context as a W3C carrier for a frame header (None when off or none is current)."""
    if not ENABLED:
        return None
    out: dict[str, str] = {}
    propagate.inject(out)
    return out or None


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The context an incoming carrier (HTTP headers, a frame's trace field) continues; empty if none."""
    return propagate.extract(headers) if headers else otel_context.Context()


@contextlib.contextmanager
def server_call(method: str, headers: Mapping[str, str] | None,
                request: msgspec.Struct | None = None) -> Iterator[trace.Span | None]:
    """A service's SERVER span for one call whose frame carried a trace context, named like the
    gateway's CLIENT span (`<service>/<Message>`, OpenTelemetry's RPC convention). Calls without a
    context (health checks, tests' raw clients) and everything while tracing is off are not traced."""
    if not ENABLED or not headers:
        yield None
        return
    with tracer().start_as_current_span(f"{SERVICE}/{method}", context=extract(headers),
                                        kind=SpanKind.SERVER) as current:
        if current.is_recording():  # not when the caller's trace was sampled out
            current.set_attributes({"rpc.system": "specserve", "rpc.service": SERVICE, "rpc.method": method})
            if request is not None:
                current.set_attributes(struct_attributes("specserve.request", request))
        yield current
