"""One streamed request against the gateway's /v1/completions, timed as `vllm bench serve` times it.

TTFT is the time to the first chunk carrying text, latency the time to the last such chunk, and
TPOT comes from those two and `usage.completion_tokens` (records.vllm_tpot_ms). The usage chunk
also carries the `specserve` extension (the request's SLO and its verify steps). Nothing here
raises for a failed request: the record says what went wrong, and the run goes on.
"""

from __future__ import annotations

import time

import aiohttp
import msgspec

from specserve.cli.loadgen.records import RequestRecord, vllm_tpot_ms
from specserve.cli.loadgen.workload import BenchRequest

_decode = msgspec.json.Decoder().decode


def request_body(req: BenchRequest, model: str, ignore_eos: bool, best_effort: bool = False) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "service_tier": req.category}
    slo: dict = {}
    if req.tpot_ms is not None:
        slo["tpot_ms"] = req.tpot_ms
    if best_effort:
        slo["best_effort"] = True
    if slo:
        body["slo"] = slo
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def send(session: aiohttp.ClientSession, url: str, req: BenchRequest, record: RequestRecord, model: str,
               ignore_eos: bool, t_start: float, best_effort: bool = False) -> RequestRecord:
    """Stream `req` to `url` (…/v1/completions) and fill `record` in; `t_start` is the run's perf_counter origin."""
    sent = time.perf_counter()
    record.sent_s = sent - t_start
    last = None
    try:
        async with session.post(url, json=request_body(req, model, ignore_eos, best_effort)) as resp:
            record.status = resp.status
            record.status_ms = (time.perf_counter() - sent) * 1e3
            if resp.status != 200:
                await _refusal(resp, record)
                return record
            buffer = b""
            async for data in resp.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        payload = line[5:].strip() if line.startswith(b"data:") else b"[DONE]"
                        if payload != b"[DONE]":
                            last = _chunk(_decode(payload), record, sent, last)
    except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError, KeyError, TypeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    if record.error is None and record.finish_reason is None:
        record.error = "the stream ended without a finish_reason"
    if last is not None and record.ttft_ms is not None:
        record.latency_ms = (last - sent) * 1e3
        record.tpot_ms = vllm_tpot_ms(record.ttft_ms, record.latency_ms, record.completion_tokens)
    return record


async def _refusal(resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
    """A response other than 200: its Retry-After (seconds) and its OpenAI error message."""
    retry = resp.headers.get("Retry-After")
    try:
        record.retry_after_s = float(retry) if retry is not None else None
    except ValueError:  # an HTTP date: kept as absent (the gateway sends seconds)
        record.retry_after_s = None
    text = await resp.text()
    try:
        record.error = _decode(text)["error"]["message"]
    except Exception:  # not an OpenAI error body
        record.error = text[:200] or resp.reason


def _chunk(chunk: dict, record: RequestRecord, sent: float, last: float | None) -> float | None:
    """One streamed chunk into `record` (times from `sent`); returns the time of the latest text so far."""
    now = time.perf_counter()
    if "error" in chunk:
        record.error = str(chunk["error"].get("message", chunk["error"]))
        return last
    for choice in chunk.get("choices") or ():
        if choice.get("text"):
            if record.ttft_ms is None:
                record.ttft_ms = (now - sent) * 1e3
            elif last is not None:
                record.itl_ms.append((now - last) * 1e3)
            last = now
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    if chunk.get("usage"):
        record.prompt_tokens = chunk["usage"]["prompt_tokens"]
        record.completion_tokens = chunk["usage"]["completion_tokens"]
    ext = chunk.get("specserve")
    if ext:
        apply_report(ext, record)
    return last


def apply_report(ext: dict, record: RequestRecord) -> None:
    """A response's `specserve` object into `record`: its verify steps, the server's TPOT, whether it ran
    best effort, and the SLO the server resolved for it (what the record is judged by)."""
    record.steps = len(ext["steps"])
    record.step_tokens = sum(1 + acc for _, _, acc in ext["steps"])
    record.server_tpot_ms = ext.get("tpot_ms")
    record.best_effort = bool(ext.get("best_effort"))
    record.slo_tpot_ms = ext["slo"]["tpot_ms"]
    record.slo_ttft_ms = ext["slo"]["ttft_ms"]
