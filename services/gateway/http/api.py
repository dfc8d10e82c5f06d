"""Turning a parsed OpenAI request into a Submission, and the engine's events into response pieces.

`Generation` runs one request: it feeds emitted tokens through the incremental detokenizer and
the stop-string matcher and yields (text, finish_reason) pieces, the echoed prompt first where asked,
and with logprobs places each token's row at its text (logprobs.py's `LogprobTrack`); the HTTP layer
(server.py) only formats them as SSE chunks or one JSON body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from specserve.gateway.engine.intake import ServiceUnavailable
from specserve.gateway.engine.request import Admitted, Event, Finished, Submission, Tokens
from specserve.gateway.frontend.local import EngineApi, kv_pool_error
from specserve.gateway.http.detokenize import IncrementalDetokenizer, StopMatcher
from specserve.gateway.http.logprobs import LogprobTrack, TokenStrings
from specserve.gateway.http.protocol import ApiError, Sampling, SloSpec
from specserve.gateway.sched.slo_classes import SloClass, resolve
from specserve.shared.wire.messages import SamplingSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class ModelInfo:
    name: str  # served model id
    max_model_len: int  # context length, tokens
    vocab_size: int
    stop_ids: frozenset[int]  # EOS token ids
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)  # the model's (generation_config)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def resolve_slo(classes: dict[str, SloClass], tier: str | None, slo: SloSpec | None) -> SloClass:
    cls = resolve(classes, tier, slo.tpot_ms if slo else None, slo.ttft_ms if slo else None)
    if cls is None:
        raise ApiError(f"unknown service_tier {tier!r}; configured classes: {', '.join(sorted(classes))}",
                       param="service_tier", code="unknown_service_tier")
    return cls


def allows_best_effort(tier: str | None, slo: SloSpec | None) -> bool:
    """Whether a request may be served without an SLO when admission cannot meet it: `slo.best_effort`
    if given, else OpenAI's `service_tier: "flex"` (slower, cheaper processing); a request that asks
    for no SLO at all (neither `slo` nor `service_tier`) always may, so that SLO-aware admission
    never refuses what FIFO would serve (it runs best effort while queue room remains)."""
    if slo is not None and slo.best_effort is not None:
        return slo.best_effort
    return tier == "flex" or (tier is None and slo is None)


def build_request(info: ModelInfo, engine: EngineApi, prompt: list[int], sampling: Sampling, slo: SloClass,
                  prefix: str, best_effort_ok: bool = False) -> Submission:
    """Check the prompt and limits against the model and the KV pool; 400 with a clear reason otherwise."""
    if not prompt:
        raise ApiError("the prompt is empty after tokenization", param="prompt")
    bad = [t for t in prompt if not 0 <= t < info.vocab_size]
    if bad:
        raise ApiError(f"token id {bad[0]} is outside the vocabulary (size {info.vocab_size})", param="prompt")
    room = info.max_model_len - len(prompt)
    if room < 1:
        raise ApiError(f"This model's maximum context length is {info.max_model_len} tokens; the prompt has "
                       f"{len(prompt)} tokens.", param="prompt", code="context_length_exceeded")
    max_tokens = sampling.max_tokens if sampling.max_tokens is not None else room
    if max_tokens > room:
        raise ApiError(f"This model's maximum context length is {info.max_model_len} tokens; {len(prompt)} prompt "
                       f"tokens + max_tokens {max_tokens} exceed it.", param="max_tokens",
                       code="context_length_exceeded")
    too_large = kv_pool_error(engine, len(prompt), max_tokens)
    if too_large is not None:
        raise ApiError(too_large, param="max_tokens")
    if sampling.min_tokens > max_tokens:
        raise ApiError(f"min_tokens {sampling.min_tokens} exceeds max_tokens {max_tokens}", param="min_tokens")
    outside = [t for t in sampling.stop_token_ids if t >= info.vocab_size]
    if outside:
        raise ApiError(f"stop token id {outside[0]} is outside the vocabulary (size {info.vocab_size})",
                       param="stop_token_ids")
    eos = frozenset() if sampling.ignore_eos else info.stop_ids
    spec = SamplingSpec(sampling.temperature, sampling.top_p, sampling.top_k,
                        None if sampling.seed is None else sampling.seed % 2**63, sampling.min_p,
                        sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty,
                        sampling.min_tokens, list(sampling.stop_token_ids),
                        sorted(eos) if sampling.min_tokens else [], len(prompt),
                        logprobs=sampling.logprobs, prompt_logprobs=sampling.echo and sampling.logprobs is not None)
    return Submission(new_id(prefix), list(prompt), spec, max_tokens, slo, eos, best_effort_ok)


def choice_submissions(sub: Submission, n: int) -> list[Submission]:
    """The n generations of a request with `n` choices: choice i is `sub` with its own id (the response's id,
    "-i" appended) and, with a seed, seed + i (as vLLM derives it), so that each choice is reproducible."""
    if n == 1:
        return [sub]
    seed = sub.sampling.seed
    return [dataclasses.replace(sub, rid=f"{sub.rid}-{i}", sampling=msgspec.structs.replace(
        sub.sampling, seed=None if seed is None else (seed + i) % 2**63)) for i in range(n)]


class Generation:
    """One submitted request's output as text pieces, from its events; aborts the request if the
    consumer leaves. Its times (arrival, admission, first token) are the handler's own. `echo`: the prompt's
    text, returned before the output; `strings`: where the request asked for logprobs, the tokens' texts
    (`logprobs` then tracks them)."""

    def __init__(self, engine: EngineApi, sub: Submission, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...],
                 echo: str | None = None, strings: TokenStrings | None = None):
        self.engine, self.sub = engine, sub
        self.echo, self.strings = echo, strings
        self.logprobs = None if strings is None else LogprobTrack(len(echo or ""))
        self.arrival = time.perf_counter()
        self.events = engine.submit(sub)  # ServiceUnavailable: refused at once
        self.detok = IncrementalDetokenizer(tokenizer, sub.prompt)
        self.stop = StopMatcher(stops)
        self.min_tokens = sub.sampling.min_tokens  # stop strings are looked for only after these tokens
        self.completion_tokens = 0  # tokens consumed into the text (those after a stop string are not)
        self.created = int(time.time())
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.report: dict | None = None  # the engine's `specserve` report, from its Finished
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self._early: Finished | None = None  # the request ended before it was admitted

    async def admitted(self) -> None:
        """Wait until the engine admits the request (before any response byte is sent); a request
        refused or failed before admission raises ServiceUnavailable (503, with Retry-After)."""
        try:
            event = await self.events.get()
        except asyncio.CancelledError:
            self.engine.abort(self.sub.rid)
            raise
        if isinstance(event, Admitted):
            self.admitted_at = time.perf_counter()
            return
        assert isinstance(event, Finished), event
        self.finish_reason, self.error, self.report = event.reason, event.error, event.report
        if event.reason == "invalid":  # refused by the engine process's own checks (--frontends)
            raise ApiError(event.error or "invalid request", param="max_tokens")
        if event.reason in ("rejected", "error"):
            raise ServiceUnavailable(event.error or "the request was refused", event.retry_after_s)
        self._early = event

    async def pieces(self) -> AsyncGenerator[str, None]:
        """Text deltas, one per wake-up: the events queued by then are taken together and their text
        joined, so a consumer that falls behind gets fewer, larger pieces. `finish_reason` (and
        `error`) are set when it ends."""
        if self._early is not None:
            return
        events = self.events
        try:
            while self.finish_reason is None:
                taken = [await events.get()]
                while not events.empty():
                    taken.append(events.get_nowait())
                text = "".join(self._text(taken))
                if text or (self.logprobs is not None and self.logprobs.ready):
                    yield text
            while self.report is None and self.finish_reason == "stop":  # ended here: the engine's report follows
                event = await events.get()
                if isinstance(event, Finished):
                    self.report = event.report or {}
        finally:
            if self.finish_reason is None:  # the consumer left (client disconnect)
                self.engine.abort(self.sub.rid)

    def _text(self, events: list[Event]) -> Iterator[str]:
        """The text of events in order, through the detokenizer and the stop matcher; sets
        finish_reason at a Finished event or a stop string (what follows is dropped)."""
        track = self.logprobs
        for event in events:
            if isinstance(event, Admitted):
                continue
            if self.echo is not None:  # before the first tokens (or the end)
                yield self.echo
                self.echo = None
            if isinstance(event, Finished):
                tail, stopped = self.detok.flush(), False
                if self.completion_tokens > self.min_tokens:
                    tail, stopped = self.stop.feed(tail)
                tail += self.stop.flush()
                if track is not None:
                    track.out(len(tail), stopped, final=not stopped)
                yield tail
                self.finish_reason, self.error, self.report = event.reason, event.error, event.report
                return
            if self.first_token_at is None and event.tokens:
                self.first_token_at = time.perf_counter()
            if track is not None:
                self._rows(track, event)
            elif not self.stop.active:  # nothing to look at token by token: the event's text in one call
                self.completion_tokens += len(event.tokens)
                yield self.detok.add(event.tokens)
                continue
            for token in event.tokens:
                self.completion_tokens += 1
                made = self.detok.add([token])
                if self.completion_tokens <= self.min_tokens:  # vLLM's rule: no stop string before min_tokens
                    piece, stopped = made, False
                else:
                    piece, stopped = self.stop.feed(made)
                if track is not None:
                    track.fed(token, len(made), len(piece), stopped)
                yield piece
                if stopped:
                    self.engine.abort(self.sub.rid, "stop")
                    self.finish_reason = "stop"
                    # the engine may have ended it already, its Finished taken in this same batch
                    self.report = next((e.report or {} for e in events if isinstance(e, Finished)), None)
                    return

    def _rows(self, track: LogprobTrack, event: Tokens) -> None:
        if event.prompt_logprobs is not None and self.strings is not None:
            track.prompt(self.sub.prompt, event.prompt_logprobs, self.strings)
        track.receive(event)

    def usage(self) -> dict:
        p, c = len(self.sub.prompt), self.completion_tokens
        usage: dict = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        cached = (self.report or {}).get("cached_tokens")
        if cached:  # OpenAI's field: prompt tokens served from the prefix cache
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def span_attributes(self) -> dict[str, Any]:
        """The request span's attributes (OpenTelemetry GenAI names, and specserve's), as of now: times as
        this handler saw them, speculation and whether the SLO was met as the engine's report says."""
        sub, report = self.sub, self.report or {}
        steps = report.get("steps") or []
        out: dict[str, Any] = {
            "gen_ai.request.id": sub.rid,
            "gen_ai.request.max_tokens": sub.max_tokens,
            "gen_ai.request.temperature": sub.sampling.temperature,
            "gen_ai.request.top_p": sub.sampling.top_p,
            "gen_ai.usage.prompt_tokens": len(sub.prompt),
            "gen_ai.usage.completion_tokens": self.completion_tokens,
            "gen_ai.latency.e2e": time.perf_counter() - self.arrival,
            "specserve.slo.tier": sub.slo.name,
            "specserve.slo.tpot_target_ms": sub.slo.tpot_ms,
            "specserve.slo.ttft_target_ms": sub.slo.ttft_ms,
            "specserve.verify_steps": len(steps),
        }
        if self.admitted_at is not None:
            out["gen_ai.latency.time_in_queue"] = self.admitted_at - self.arrival
        if sub.final_only and report.get("ttft_ms") is not None:  # its tokens came at its end: the engine's time
            out["gen_ai.latency.time_to_first_token"] = report["ttft_ms"] / 1e3
        elif self.first_token_at is not None:
            out["gen_ai.latency.time_to_first_token"] = self.first_token_at - self.arrival
        if report.get("tpot_ms") is not None:
            out["specserve.tpot_ms"] = report["tpot_ms"]
            out["specserve.slo.met"] = bool(report.get("slo_met"))
        if steps:
            out["specserve.tokens_per_step"] = sum(acc + 1 for _, _, acc in steps) / len(steps)
        if report.get("replica") is not None:
            out["specserve.replica"] = report["replica"]
        if self.finish_reason is not None:
            out["specserve.finish_reason"] = self.finish_reason
        return out
