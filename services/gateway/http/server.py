"""The gateway's HTTP server: OpenAI-compatible endpoints on aiohttp (uvloop), one Engine behind them.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as SSE, or one JSON body),
GET /v1/models, GET /v1/slo_classes, GET /health, GET /metrics.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.grammar import GrammarError, Grammars, RequestGrammar
from specserve.gateway.engine.intake import ServiceUnavailable
from specserve.gateway.frontend.local import EngineApi
from specserve.gateway.http.api import (
    Generation,
    ModelInfo,
    allows_best_effort,
    build_request,
    choice_submissions,
    resolve_slo,
)
from specserve.gateway.http.choices import Choices
from specserve.gateway.http.guided import grammar_spec
from specserve.gateway.http.logprobs import TokenStrings, chat_logprobs, completion_logprobs
from specserve.gateway.http.parse import parse_chat, parse_completion
from specserve.gateway.http.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    messages_of,
    prompt_of,
    sampling_of,
)
from specserve.gateway.http.tokenize import Tokenizing
from specserve.gateway.obs import spans
from specserve.gateway.obs.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("specserve.gateway")
_json = msgspec.json.Encoder()
COMPILE_TIMEOUT_S = 30.0  # a grammar that takes longer to compile is refused (400)


def error_response(exc: ApiError) -> web.Response:
    return web.Response(status=exc.status, body=_json.encode(exc.body()), content_type="application/json")


class Gateway:
    """The HTTP front end: the engine it serves is in this process (`LocalEngine`) or in another one
    (`frontend.remote.RemoteEngine`, with `--frontends N`)."""

    def __init__(self, config: GatewayConfig, tokenizer: PreTrainedTokenizerBase, info: ModelInfo, engine: EngineApi,
                 grammars: Grammars | None = None):
        """grammars: structured output's compiler and cache (the engine's, where it runs in this process)."""
        self.config, self.tokenizer, self.info, self.engine = config, tokenizer, info, engine
        self.grammars = grammars or Grammars(tokenizer, info.vocab_size, info.stop_ids)
        # a front end of --frontends names itself in its streams' headers (which process a client reached)
        self.stream_headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if config.frontend_of:
            self.stream_headers["X-Specserve-Frontend"] = str(os.getpid())
        self.tokenizing = Tokenizing(tokenizer, info.max_model_len)  # off the event loop
        self.strings = TokenStrings(tokenizer)  # tokens' texts and bytes, for logprobs

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
        sampling = sampling_of(req, self.info.sampling_defaults)
        slo = resolve_slo(self.engine.classes, req.service_tier, req.slo)
        sub = build_request(self.info, self.engine, prompt_ids, sampling, slo, prefix,
                            allows_best_effort(req.service_tier, req.slo))
        grammar = await self._grammar(req)
        if grammar is not None:
            sub = replace(sub, grammar=grammar)
        if not req.stream and not sampling.stop and sampling.logprobs is None:
            sub = replace(sub, final_only=True)  # the text is read once, at the end
        choices = Choices(self.engine, sub.rid, choice_submissions(sub, sampling.n), self.tokenizer, sampling.stop,
                          self._echo(req, prompt_ids), None if sampling.logprobs is None else self.strings)
        request[spans.ATTRIBUTES] = choices.span_attributes  # the request span's attributes at the end (tracing on)
        await choices.admitted()  # refused before admission: 503 before any response byte
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return await self._stream(request, choices, chat, usage)
        texts = await choices.texts()
        failed = next((gen for gen in choices.gens if gen.finish_reason == "error"), None)
        if failed is not None:
            raise web.HTTPInternalServerError(reason=failed.error or "generation failed")
        out = []
        for i, (gen, text) in enumerate(zip(choices.gens, texts)):
            choice: dict[str, object] = {"index": i, "finish_reason": gen.finish_reason,
                                         "logprobs": self._logprobs(gen, chat)}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if len(texts) > 1:
                choice["specserve"] = gen.report  # each choice's own report (the top level's is choice 0's)
            out.append(choice)
        gen = choices.first
        return web.json_response({"id": choices.rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": gen.created, "model": self.info.name, "choices": out,
                                  "usage": choices.usage(), "service_tier": slo.name, "specserve": gen.report})

    async def _grammar(self, req: CompletionRequest | ChatCompletionRequest) -> RequestGrammar | None:
        """Structured output's compiled grammar (from the cache, else compiled off the event loop); a spec
        xgrammar refuses is a 400 naming its field, with xgrammar's reason."""
        spec = grammar_spec(req)
        if spec is None:
            return None
        try:
            return await asyncio.wait_for(self.grammars.compile_async(spec), COMPILE_TIMEOUT_S)
        except GrammarError as exc:
            raise ApiError(f"invalid {exc.message}", param=exc.field) from None
        except TimeoutError:
            raise ApiError(f"{spec.field} did not compile within {COMPILE_TIMEOUT_S:g} s", param=spec.field) from None

    async def _stream(self, request: web.Request, choices: Choices, chat: bool, usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers=self.stream_headers)
        self._bound(request)
        await resp.prepare(request)
        gens = choices.gens
        base = {"id": choices.rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": gens[0].created, "model": self.info.name}
        chunk = chunk_encoder(base, chat)

        def with_logprobs(index: int, text: str) -> bytes:  # with the logprobs of the tokens whose text it carries
            return chunk(index, text, None, logprobs=self._logprobs(gens[index], chat))

        piece_chunks = [framed(functools.partial(chunk, i, finish=None)) if gen.logprobs is None
                        else functools.partial(with_logprobs, i) for i, gen in enumerate(gens)]
        pieces = choices.pieces()
        ended = 0
        end = []  # the last events go out in one write (one socket send instead of three)
        try:
            if chat:  # the role chunk first (anchors.md §3), one per choice
                await self._send(resp, b"".join(chunk(i, None, None, role=True) for i in range(len(gens))))
            async for index, piece in pieces:
                if piece is not None:
                    await self._send(resp, piece_chunks[index](piece))
                    continue
                ended += 1
                gen = gens[index]
                if gen.finish_reason == "error":
                    err = {"error": {"message": gen.error, "type": "server_error", "param": None, "code": 500}}
                    end.append(b"data: " + _json.encode(err) + b"\n\n")
                else:
                    end.append(chunk(index, None, gen.finish_reason))
                if ended < len(gens):  # an earlier choice's end goes out now; the last one's with the rest
                    await self._send(resp, b"".join(end))
                    end.clear()
        except TimeoutError:
            await pieces.aclose()  # ends every choice: their KV is freed at once
            return self._cut(request, resp, choices)
        if usage:
            last: dict[str, object] = {**base, "choices": [], "usage": choices.usage(), "specserve": gens[0].report}
            end.append(b"data: " + _json.encode(last) + b"\n\n")
        end.append(b"data: [DONE]\n\n")
        try:
            await self._send(resp, b"".join(end))
        except TimeoutError:
            return self._cut(request, resp, choices)
        await resp.write_eof()
        return resp

    def _echo(self, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]) -> str | None:
        """The text `echo` returns before the completion: the prompt as sent, or its token ids decoded."""
        if not isinstance(req, CompletionRequest) or not req.echo:
            return None
        prompt = prompt_of(req)
        if isinstance(prompt, str):
            return prompt
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        return text if isinstance(text, str) else "".join(text)

    def _logprobs(self, gen: Generation, chat: bool) -> dict | None:
        """The `logprobs` object of the tokens released since the last call (None where not asked)."""
        if gen.logprobs is None:
            return None
        entries = gen.logprobs.take()
        return chat_logprobs(entries, self.strings) if chat else completion_logprobs(entries, self.strings)

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

    def _cut(self, request: web.Request, resp: web.StreamResponse, choices: Choices) -> web.StreamResponse:
        """End a stream whose client stopped reading: its request is already ended; the connection is
        dropped with what it still holds."""
        self.engine.count_error("client_too_slow")
        log.warning("request %s: the client took no bytes for %g s with its buffers full (%d bytes each); "
                    "cut after %d tokens", choices.first.sub.rid, self.config.stream_stall_s,
                    self.config.stream_buffer_bytes, choices.usage()["completion_tokens"])
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:  # a reset: the bytes still queued for the client are dropped too
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        return resp


def chunk_encoder(base: dict, chat: bool) -> Callable[..., bytes]:
    """chunk(index, text, finish, role=False, logprobs=None) -> one SSE event of a streamed response (`base`: its
    id, object, created and model): choice `index`'s text piece (with its tokens' logprobs object), its end
    (finish reason), or for chat its role chunk."""

    def chunk(index: int, text: str | None, finish: str | None, role: bool = False,
              logprobs: dict | None = None) -> bytes:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return b"data: " + _json.encode({**base, "choices": [choice]}) + b"\n\n"

    return chunk


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
