"""Tracing (shared/process/tracing.py, services/gateway/obs/spans.py): OpenTelemetry spans across the gateway,
the draft and the target.

Here: the tests that start the whole stack; the others are in tests/unit/test_tracing.py and
tests/service/test_tracing.py.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.support import poll
from tests.support.fixtures import BUDGET_24, start_up
from tests.support.procs import Up

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "bench/results/sweep-full/profile.json"  # a measured profile: no profiling at start
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


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


@pytest.fixture(scope="module")
def traced_up(request):
    return _traced(request)


def _wait_for(receiver: OtlpReceiver, done, timeout_s: float = 60) -> list[SpanData]:
    return poll.until(receiver.spans, timeout_s, "the spans the test looks for", ok=done, interval_s=0.2,
                      show=lambda spans: f"{len(spans)} spans: {sorted({(s.service, s.name) for s in spans})}")


def test_span_tree_of_one_streamed_request_across_three_processes(traced_up):
    up, receiver = traced_up
    c = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = c.completions.create(model="target", prompt="import os\nimport sys\n\n\ndef main():\n", max_tokens=24,
                                  temperature=0, stream=True, stream_options={"include_usage": True},
                                  extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    chunks = list(stream)
    rid, usage, ext = chunks[0].id, chunks[-1].usage, chunks[-1].model_extra["specserve"]
    assert usage is not None and usage.completion_tokens > 0

    def request_span(spans: list[SpanData]) -> SpanData | None:
        return next((s for s in spans if s.name == "llm_request" and s.attrs.get("gen_ai.request.id") == rid), None)

    def complete(spans: list[SpanData]) -> bool:
        """The request span, and every CLIENT call of the iterations linked to it with its served span (each
        process exports on its own schedule: a call's served span may come after the gateway's spans)."""
        req = request_span(spans)
        if req is None:
            return False
        linked = {s.span_id for s in spans if (req.trace_id, req.span_id) in s.links}
        calls = {s.span_id for s in spans if s.parent in linked and s.kind == 3}
        served = {s.parent: s.service for s in spans if s.parent in calls}
        services = set(served.values())
        return bool(calls) and calls <= served.keys() and {"specserve-draft", "specserve-target"} <= services

    spans = _wait_for(receiver, complete)
    by_id = {s.span_id: s for s in spans}

    # the request span: continues the incoming traceparent, vLLM's gen_ai.* attributes plus ours
    req = request_span(spans)
    assert req is not None, sorted({(s.service, s.name) for s in spans})
    assert (req.service, req.kind, req.trace_id, req.parent) == ("specserve-gateway", 2, TRACE_ID, PARENT_ID)
    a = req.attrs
    assert a["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == usage.completion_tokens
    assert a["gen_ai.request.max_tokens"] == 24 and a["gen_ai.response.model"] == "target"
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert (a["specserve.slo.tier"], a["specserve.slo.tpot_target_ms"]) == (ext["slo"]["tier"], ext["slo"]["tpot_ms"])
    assert a["specserve.tpot_ms"] == pytest.approx(ext["tpot_ms"], abs=1e-3)
    steps = {step: (nodes, acc) for step, nodes, acc in ext["steps"]}  # engine step -> (tree nodes, accepted)
    assert a["specserve.verify_steps"] == len(steps) > 0
    assert a["specserve.tokens_per_step"] == pytest.approx(sum(acc + 1 for _, acc in steps.values()) / len(steps))
    assert a["http.response.status_code"] == 200 and a["url.path"] == "/v1/completions"

    # the iterations that served it: their own traces, linked to the request span
    iterations = [s for s in spans if s.name == "engine.iteration" and (req.trace_id, req.span_id) in s.links]
    assert iterations and all(s.trace_id != TRACE_ID and s.parent == "" for s in iterations)
    assert len(iterations) == a["specserve.verify_steps"] + 1  # one prefill iteration, then verify steps
    assert sum(s.attrs["specserve.batch_size"] for s in iterations) == len(iterations)  # it ran alone
    for it in iterations:
        assert {"specserve.tree_nodes", "specserve.accepted_tokens", "specserve.draft_ms", "specserve.target_ms",
                "specserve.transport_ms", "specserve.schedule_ms", "specserve.total_ms"} <= it.attrs.keys()
        parts = sum(it.attrs[f"specserve.{p}_ms"] for p in ("draft", "target", "transport", "schedule"))
        assert parts == pytest.approx(it.attrs["specserve.total_ms"], abs=0.01)
        kids = [s for s in spans if s.parent == it.span_id]
        names = sorted(s.name for s in kids)
        assert "target/Forward" in names and "policy.select" in names, names
        assert all(s.trace_id == it.trace_id for s in kids)
    # it ran alone, so each verify iteration's record is its step: tree nodes and accepted tokens
    verify = {s.attrs["specserve.step"]: (s.attrs["specserve.tree_nodes"], s.attrs["specserve.accepted_tokens"])
              for s in iterations if s.attrs["specserve.decode_requests"]}
    assert verify == steps

    # the services' spans: children of the gateway's CLIENT call spans, in the draft and target processes
    speculated = 0
    for it in iterations:
        for call in (s for s in spans if s.parent == it.span_id and s.kind == 3):
            served = [s for s in spans if s.parent == call.span_id]
            assert len(served) == 1, (call.name, served)
            srv = served[0]
            assert (srv.name, srv.kind, srv.trace_id) == (call.name, 2, call.trace_id)
            assert srv.service == "specserve-" + call.name.split("/")[0]
            assert call.start_ns <= srv.start_ns and srv.end_ns <= call.end_ns
            assert srv.attrs["rpc.service"] == call.name.split("/")[0]
            if call.name == "target/Forward":
                assert srv.attrs["specserve.reply.results.count"] == 1 and "specserve.reply.forward_ms" in srv.attrs
            if call.name == "draft/Speculate":
                speculated += 1
                assert srv.attrs["specserve.request.entries.count"] == 1 and "specserve.reply.beam_ms" in srv.attrs
        assert by_id.get(it.span_id) is it
    assert speculated > 0  # adaserve speculated for it at least once


def test_what_the_exporter_sends_is_otlp_http_protobuf(traced_up):
    """Every export the receiver got is a POST to /v1/traces of application/x-protobuf that decodes as
    ExportTraceServiceRequest, from all three services, each span with a 16-byte trace id."""
    up, receiver = traced_up
    spans = _wait_for(receiver, lambda s: {"specserve-gateway", "specserve-draft", "specserve-target"}
                      <= {x.service for x in s})
    assert receiver.posts
    assert {(path, ctype) for path, ctype, _ in receiver.posts} == {("/v1/traces", "application/x-protobuf")}
    assert {"specserve-gateway", "specserve-draft", "specserve-target"} <= {s.service for s in spans}
    assert all(len(s.trace_id) == 32 and len(s.span_id) == 16 for s in spans)
    assert all(0 < s.start_ns <= s.end_ns for s in spans)


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
