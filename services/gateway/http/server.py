"""The gateway's HTTP server: OpenAI-compatible endpoints on aiohttp (uvloop), one Engine behind them.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as SSE, or one JSON body),
GET /v1/models, GET /v1/slo_classes, GET /health, GET /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from specserve.gateway.backends.discovery import Resolver, TargetDiscovery
from specserve.gateway.backends.discovery import stop as stop_discovery
from specserve.gateway.backends.pool import DraftService, ServicePool, TargetReplica
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.core import Engine, EngineLimits, ServiceUnavailable
from specserve.gateway.engine.front import EngineApi, LocalEngine
from specserve.gateway.http.api import Generation, ModelInfo, allows_best_effort, build_request, resolve_slo
from specserve.gateway.http.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    messages_of,
    parse_chat,
    parse_completion,
    prompt_of,
    sampling_of,
)
from specserve.gateway.http.tokenize import Tokenizing
from specserve.gateway.obs import spans
from specserve.gateway.obs.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.admission.slo import SloAdmission
from specserve.gateway.sched.policy import Policy, make_policy, option_classes
from specserve.gateway.sched.routing import make_router
from specserve.gateway.sched.scheduler import Scheduler
from specserve.gateway.sched.slo import default_classes, parse_class
from specserve.shared import tracing
from specserve.shared.auth import AuthError, load_secret
from specserve.shared.lifeline import follow_parent
from specserve.shared.model_store import resolve_or_exit
from specserve.shared.ports import check_port_free, port_in_use_as_error

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("specserve.gateway")
_json = msgspec.json.Encoder()
# Allocations between two young-generation collections (CPython's default: 700). An iteration at 1,000
# streams allocates tens of thousands of short-lived containers (messages, views, SSE chunks); at 700
# many are caught alive mid-iteration, promoted, and the older generations then fill and get walked.
GC_YOUNG_THRESHOLD = 50_000
ENGINE_WAIT_S = 120.0  # a front end waits this long for its engine's link to accept it


def error_response(exc: ApiError) -> web.Response:
    return web.Response(status=exc.status, body=_json.encode(exc.body()), content_type="application/json")


class Gateway:
    """The HTTP front end: the engine it serves is in this process (`LocalEngine`) or in another one
    (`frontend.remote.RemoteEngine`, with `--frontends N`)."""

    def __init__(self, config: GatewayConfig, tokenizer: PreTrainedTokenizerBase, info: ModelInfo, engine: EngineApi):
        self.config, self.tokenizer, self.info, self.engine = config, tokenizer, info, engine
        # a front end of --frontends names itself in its streams' headers (which process a client reached)
        self.stream_headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if config.frontend_of:
            self.stream_headers["X-Specserve-Frontend"] = str(os.getpid())
        self.tokenizing = Tokenizing(tokenizer, info.max_model_len)  # off the event loop

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 * 2**20,
                              middlewares=[*spans.middlewares(self.info.name), self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/slo_classes", self.slo_classes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            self.engine.count_error(exc.code or "invalid_request")
            return error_response(exc)
        except ServiceUnavailable as exc:
            resp = error_response(ApiError(str(exc), status=503, type="service_unavailable"))
            if exc.retry_after_s is not None:
                resp.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            return resp
        except web.HTTPException as exc:
            if exc.status >= 400:
                return error_response(ApiError(exc.reason, status=exc.status,
                                               type="invalid_request_error" if exc.status < 500 else "server_error"))
            raise

    # ---- endpoints ---------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> bytes:
        """The request body, within the client timeout (a client that trickles it gets 408)."""
        try:
            async with asyncio.timeout(self.config.client_timeout_s):
                return await request.read()
        except TimeoutError:
            raise ApiError(f"the request body did not arrive within {self.config.client_timeout_s:g} s",
                           status=408, code="request_timeout") from None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion(await self._body(request))
        self._check_model(req.model)
        prompt = prompt_of(req)
        ids = await self.tokenizing.encode(prompt) if isinstance(prompt, str) else prompt
        return await self._serve(request, req, ids, "cmpl", chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat(await self._body(request))
        self._check_model(req.model)
        ids = await self.tokenizing.chat(messages_of(req))
        return await self._serve(request, req, ids, "chatcmpl", chat=True)

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.info.name, "object": "model", "created": 0, "owned_by": "specserve",
            "root": self.config.model, "max_model_len": self.info.max_model_len}]})

    async def slo_classes(self, _request: web.Request) -> web.Response:
        return web.json_response(await self.engine.slo_classes())

    async def health(self, _request: web.Request) -> web.Response:
        status, body = await self.engine.health()
        return web.json_response(body, status=status)

    async def metrics(self, _request: web.Request) -> web.Response:
        text = await self.engine.metrics_text()
        return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    # ---- one generation ----------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model not in (self.info.name, self.config.model):
            raise ApiError(f"The model `{model}` does not exist; this server serves `{self.info.name}`.",
                           param="model", code="model_not_found")

    async def _serve(self, request: web.Request, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                     prefix: str, chat: bool) -> web.StreamResponse:
        sampling = sampling_of(req)
        slo = resolve_slo(self.engine.classes, req.service_tier, req.slo)
        gen_req = build_request(self.info, self.engine, prompt_ids, sampling, slo, prefix)
        gen_req.best_effort_ok = allows_best_effort(req.service_tier, req.slo)
        self.engine.submit(gen_req)
        gen = Generation(self.engine, gen_req, self.tokenizer, sampling.stop)
        request[spans.GENERATION] = gen  # the request span's attributes at the end (when tracing is on)
        await gen.admitted()  # refused before admission: 503 before any response byte
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return await self._stream(request, gen, chat, usage)
        text = "".join([piece async for piece in gen.pieces()])
        if gen.finish_reason == "error":
            raise web.HTTPInternalServerError(reason=gen.error or "generation failed")
        choice: dict[str, object] = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({"id": gen_req.rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": gen.created, "model": self.info.name, "choices": [choice],
                                  "usage": gen.usage(), "service_tier": slo.name, "specserve": gen_req.report()})

    async def _stream(self, request: web.Request, gen: Generation, chat: bool, usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers=self.stream_headers)
        self._bound(request)
        await resp.prepare(request)
        base = {"id": gen.req.rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": gen.created, "model": self.info.name}

        def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return b"data: " + _json.encode({**base, "choices": [choice]}) + b"\n\n"

        piece_chunk = framed(lambda text: chunk(text, None))
        pieces = gen.pieces()
        try:
            if chat:  # the role chunk first (anchors.md §3)
                await self._send(resp, chunk(None, None, role=True))
            async for piece in pieces:
                await self._send(resp, piece_chunk(piece))
        except TimeoutError:
            await pieces.aclose()  # ends the request: its KV is freed at once
            return self._cut(request, resp, gen)
        end = []  # the last events go out in one write (one socket send instead of three)
        if gen.finish_reason == "error":
            err = {"error": {"message": gen.error, "type": "server_error", "param": None, "code": 500}}
            end.append(b"data: " + _json.encode(err) + b"\n\n")
        else:
            end.append(chunk(None, gen.finish_reason))
        if usage:
            last: dict[str, object] = {**base, "choices": [], "usage": gen.usage(), "specserve": gen.req.report()}
            end.append(b"data: " + _json.encode(last) + b"\n\n")
        end.append(b"data: [DONE]\n\n")
        try:
            await self._send(resp, b"".join(end))
        except TimeoutError:
            return self._cut(request, resp, gen)
        await resp.write_eof()
        return resp

    def _bound(self, request: web.Request) -> None:
        """Cap what a stream's connection holds unsent: the socket's send buffer and the transport's."""
        transport, limit = request.transport, self.config.stream_buffer_bytes
        if transport is None:
            return
        transport.set_write_buffer_limits(high=limit)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limit)

    async def _send(self, resp: web.StreamResponse, data: bytes) -> None:
        """One write; TimeoutError when the client takes none of the waiting bytes for --stream-stall-s."""
        async with asyncio.timeout(self.config.stream_stall_s):
            await resp.write(data)

    def _cut(self, request: web.Request, resp: web.StreamResponse, gen: Generation) -> web.StreamResponse:
        """End a stream whose client stopped reading: its request is already ended; the connection is
        dropped with what it still holds."""
        self.engine.count_error("client_too_slow")
        log.warning("request %s: the client took no bytes for %g s with its buffers full (%d bytes each); "
                    "cut after %d tokens", gen.req.rid, self.config.stream_stall_s, self.config.stream_buffer_bytes,
                    len(gen.req.output))
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:  # a reset: the bytes still queued for the client are dropped too
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        return resp


_MARK = "\x00specserve-piece\x00"


def framed(encode: Callable[[str], bytes]) -> Callable[[str], bytes]:
    """`encode` (one text piece -> its SSE event) as the bytes around the piece, encoded once, with the
    piece's JSON string between them: the same bytes (a JSON string encodes the same wherever it
    stands) without building and encoding the whole event for every token. `encode` itself where
    the marker does not appear exactly once in its output."""
    template = encode(_MARK)
    mark = _json.encode(_MARK)
    if template.count(mark) != 1:
        return encode
    head, _, tail = template.partition(mark)
    return lambda text: head + _json.encode(text) + tail


# ---- process -------------------------------------------------------------------------------------
async def load_cost(config: GatewayConfig, vocab_size: int,
                       target: str) -> tuple[Callable[[], PassCost], Path]:
    """The profile (budget B, baseline latency, curve); measured against the target now if missing."""
    from specserve.gateway.perf import profile as profiling
    from specserve.shared.service_client import TargetClient

    client = await TargetClient.connect(target)
    try:
        fingerprint = (await client.health()).fingerprint
        path = (Path(config.profile) if config.profile
                else profiling.default_profile_path(config.model, config.device, fingerprint))
        if path.is_file():
            prof = profiling.Profile.load(path)
            if prof.fingerprint and fingerprint and prof.fingerprint != fingerprint:
                print(f"warning: the profile {path} was measured on a target unlike this one ({prof.fingerprint}; "
                      f"this one: {fingerprint}); its budget and SLO classes may not fit. Leave out --profile to "
                      "use one measured on this target.", file=sys.stderr, flush=True)
        else:
            print(f"no profile at {path}: measuring the target now (specserve profile)", file=sys.stderr, flush=True)
            prof = await profiling.measure(client, vocab_size=vocab_size)
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.model, prof.device = config.model, config.device
            prof.save(path)
            print(f"profile saved to {path}: B = {prof.budget_tokens} tokens, baseline iteration "
                  f"{prof.baseline_iteration_ms:.2f} ms", file=sys.stderr, flush=True)
    finally:
        await client.close()
    budget = config.budget if config.budget else prof.budget_tokens
    return (lambda: PassCost(budget, prof.baseline_iteration_ms, list(prof.curve))), path


def model_info(config: GatewayConfig) -> tuple[PreTrainedTokenizerBase, ModelInfo]:
    from transformers import AutoTokenizer

    from specserve.shared.model_config import ModelConfig
    from specserve.shared.service_base import exit_on_load_error

    cfg = exit_on_load_error(lambda: ModelConfig.from_dir(config.model))
    tokenizer = exit_on_load_error(lambda: AutoTokenizer.from_pretrained(config.model))
    stops = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    return tokenizer, ModelInfo(config.served_model_name or config.model, cfg.max_position_embeddings, cfg.vocab_size,
                                frozenset(stops))


async def run(config: GatewayConfig, policy: Policy) -> int:
    tracing.setup("gateway")  # on if OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT is set (shared/tracing.py)
    tokenizer, info = model_info(config)
    resolver = Resolver(config.hosts_file)
    discovery = TargetDiscovery(config.target, resolver, config.discovery_interval_s)
    addresses = list(config.target)
    if config.discover_targets:
        found = await discovery.addresses()
        if not found:
            raise ConnectionError(f"the target names {config.target} resolve to no address")
        addresses = found
    new_cost, profile_path = await load_cost(config, info.vocab_size, addresses[0])
    cost = new_cost()
    classes = default_classes(cost.baseline_iteration_ms)
    for spec in config.slo_classes:
        cls = parse_class(spec)
        classes[cls.name] = cls
    targets = [TargetReplica(i, address, new_cost()) for i, address in enumerate(addresses)]
    draft = DraftService(await resolver.first(config.draft)) if policy.uses_draft else None
    pool = ServicePool(targets, draft, new_cost)
    admission = SloAdmission(route_all=config.router == "slo") if config.admission == "slo" else None
    scheduler = Scheduler(policy, make_router(config.router), sync_draft=config.draft_sync == "eager",
                          admission=admission)
    limits = EngineLimits(config.max_running, config.max_prefill_tokens, max_waiting=config.max_waiting,
                          kv_lookahead_tokens=config.kv_lookahead_tokens)
    metrics = GatewayMetrics(info.name)
    metrics.prime_tiers(classes)  # every tier's labelled series, at 0
    engine = Engine(policy, scheduler, pool, metrics, limits, config.call_timeout_s, config.overlap,
                    config.overlap_miss == "draft", config.draft_window_ms)
    await engine.start()
    rediscover = discovery.start(pool.set_addresses) if config.discover_targets else None
    local = LocalEngine(engine, classes, profile_path)
    link = await _open_link(config.frontend_link, local) if config.frontend_link else None
    if config.frontends > 0:
        serving = await _start_frontends(config, local)
    else:
        serving = await _serve_http(config, Gateway(config, tokenizer, info, local), reuse_port=False)
    log.info("policy %s, budget B = %d tokens, baseline %.2f ms, classes %s", policy.name, cost.budget_tokens,
             cost.baseline_iteration_ms, {n: c.tpot_ms for n, c in classes.items()})
    await _until_stopped()
    await stop_discovery(rediscover)
    await serving()
    if link is not None:
        link.close()
    await engine.close()
    tracing.shutdown()  # export the spans still buffered
    return 0


async def _serve_http(config: GatewayConfig, gateway: Gateway, reuse_port: bool,
                      role: str = "gateway") -> Callable[[], Awaitable[None]]:
    """The HTTP server on config.host:port, the ready line; returns its cleanup."""
    # keepalive_timeout also bounds a new connection that does not finish a request head (slow headers)
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=config.client_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=reuse_port or None)
    with port_in_use_as_error(config.port):
        await site.start()
    port = runner.addresses[0][1]
    _freeze_startup_objects()
    print(f"ready {role} http://{config.host}:{port}", flush=True)
    return runner.cleanup


async def _start_frontends(config: GatewayConfig, local: LocalEngine) -> Callable[[], Awaitable[None]]:
    """--frontends N: the link on a Unix socket in a private directory, then N front ends on one port."""
    from specserve.gateway.frontend.link import FrontendLink
    from specserve.gateway.frontend.procs import Frontends, frontend_command
    from specserve.launch import free_port

    directory = tempfile.mkdtemp(prefix="specserve-frontends-")
    address = "unix:" + os.path.join(directory, "engine.sock")
    server = await FrontendLink(local, load_secret()).start(address)
    port = config.port or free_port(config.host)
    frontends = Frontends(config.frontends, frontend_command(sys.argv, port, address))
    await frontends.start()
    _freeze_startup_objects()
    print(f"ready gateway http://{config.host}:{port}", flush=True)

    async def cleanup() -> None:
        await frontends.stop()
        server.close()
        shutil.rmtree(directory, ignore_errors=True)

    return cleanup


async def _open_link(address: str, local: LocalEngine) -> asyncio.Server:
    """--frontend-link HOST:PORT: the engine also serves front ends run on their own there."""
    from specserve.gateway.frontend.link import FrontendLink

    server = await FrontendLink(local, load_secret()).start(address)
    log.info("front ends are accepted at %s (they prove the shared secret)", address)
    return server


async def run_frontend(config: GatewayConfig) -> int:
    """One front end (--frontend-of): HTTP, tokenization and streaming for the engine process."""
    from specserve.gateway.frontend.remote import RemoteEngine

    tracing.setup("gateway-frontend")
    tokenizer, info = model_info(config)
    assert config.frontend_of is not None
    try:
        remote = await RemoteEngine.connect_retrying(config.frontend_of, load_secret(), ENGINE_WAIT_S)
    except AuthError as exc:
        print(f"error: cannot authenticate to the engine at {config.frontend_of}: {exc}", file=sys.stderr)
        return 1
    except ConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    cleanup = await _serve_http(config, Gateway(config, tokenizer, info, remote), reuse_port=True, role="frontend")
    stopped = asyncio.ensure_future(_until_stopped())
    gone = asyncio.ensure_future(remote.closed.wait())
    await asyncio.wait([stopped, gone], return_when=asyncio.FIRST_COMPLETED)
    for task in (stopped, gone):
        task.cancel()
    await cleanup()
    await remote.close()
    tracing.shutdown()
    return 0 if stopped.done() and not gone.done() else 1


def _freeze_startup_objects() -> None:
    """What startup loaded (torch, transformers, the tokenizer: some 350,000 objects) lives as long as
    the process: take it out of the cyclic collector's generations, or every full collection walks it
    all again, a pause of tens of ms that lands in whichever iteration allocates (docs/simulation.md,
    Scale)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=os.environ.get("SPECSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = GatewayConfig.from_args(args)
    config.model = resolve_or_exit(config.model)  # a named model: its directory (its tokenizer, its name)
    try:
        policy = make_policy(config.policy, {cls: cls.from_args(args) for cls in option_classes()})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    follow_parent()  # started by `specserve up` (or a front end by its engine process): die with it
    import uvloop

    load_secret()  # the services' shared secret: none is one line and exit 2, before anything loads
    if config.frontend_of:  # no port check: front ends share their port (SO_REUSEPORT)
        return uvloop.run(run_frontend(config))
    check_port_free(config.host, config.port)  # taken: one line and exit 1 (the bind says the same)
    import torch

    torch.set_num_threads(config.threads)
    try:
        return uvloop.run(run(config, policy))
    except AuthError as exc:
        print(f"error: cannot authenticate to the services: {exc}", file=sys.stderr)
        return 1
    except (ConnectionError, OSError) as exc:
        print(f"error: cannot reach the services ({config.draft}, {config.target}): {exc}", file=sys.stderr)
        return 1
