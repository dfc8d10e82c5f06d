"""Parsing and validating OpenAI request bodies: `parse_completion` and `parse_chat`.

They turn the JSON body of ``POST /v1/completions`` and ``POST /v1/chat/completions`` into the
Structs of protocol.py and validate every field the gateway acts on; anything invalid raises
`ApiError`, which the server turns into an HTTP response in OpenAI's error shape. Fields the gateway
does not know are ignored (clients send many), but a known feature the gateway does not implement
(best_of above n, suffix, chat's echo, logit bias, tools and function calls, ...) is refused with a 400
naming it unless it is absent, null or its neutral value (`UNSUPPORTED`), rather than silently dropped.
The sampling fields (penalties, min_p, min_tokens, stop_token_ids, n) are checked against vLLM's limits
(`_check_sampling`); structured output's fields (`response_format`, vLLM's `guided_*`) by
http/guided.py. Every
malformed body (not UTF-8, not JSON, nested too deep, a wrong type anywhere) is a 400 too, never an
exception out of this module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import msgspec

from specserve.gateway.http.guided import grammar_spec
from specserve.gateway.http.protocol import ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest
from specserve.shared.spec.logprobs import MAX_LOGPROBS
from specserve.shared.spec.sampling import PENALTY_LIMIT

__all__ = ["UNSUPPORTED", "parse_chat", "parse_completion"]

MAX_TOKENS_LIMIT = 1_000_000  # absurd values are refused here; the server checks the context length
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_SLO_MS = 3_600_000.0
MAX_N = 16  # choices per request (n); each is a generation of its own
MAX_STOP_TOKEN_IDS = 128
SEED_MIN, SEED_END = -(2**63), 2**64  # seed in [SEED_MIN, SEED_END)
CHAT_ROLES = frozenset({"system", "user", "assistant", "developer"})


# ---------------------------------------------------------------------------------------------- parsing

_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
_CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
_AT_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")


def _decode(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """The body as a request Struct; every way it can be malformed is an ApiError (400)."""
    if not body or not body.strip():
        raise ApiError("The request body is empty; expected a JSON object.")
    try:
        body.decode("utf-8")  # JSON is UTF-8 (RFC 8259); msgspec would raise on bad bytes only in some fields
    except UnicodeDecodeError as exc:
        raise ApiError(f"The request body is not valid UTF-8: {exc}") from None
    try:
        return decoder.decode(body)
    except RecursionError:
        raise ApiError("The request body nests JSON arrays or objects too deeply.") from None
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _AT_PATH.search(message)
        path = match.group("path") if match else ""
        missing = _MISSING.match(message)
        if missing:
            path = f"{path}.{missing.group('field')}" if path else missing.group("field")
        raise ApiError(f"Invalid request: {message}", param=path or None) from None
    except msgspec.DecodeError as exc:
        raise ApiError(f"The request body is not valid JSON: {exc}") from None
    except (ValueError, OverflowError, MemoryError) as exc:  # anything else msgspec refuses to build
        raise ApiError(f"The request body could not be decoded: {exc}") from None


def parse_completion(body: bytes) -> CompletionRequest:
    """Decode and validate a ``/v1/completions`` body; raises `ApiError` (400) when it is invalid."""
    req: CompletionRequest = _decode(_COMPLETION_DECODER, body)
    _check_common(req)
    _check_prompt(req.prompt)
    _check_max_tokens(req.max_tokens, "max_tokens")
    _check_sampling(req)
    _check_logprob_count(req.logprobs, "logprobs")
    if req.top_logprobs:
        raise ApiError(f"top_logprobs is a chat parameter; completions take logprobs: N (0..{MAX_LOGPROBS}), got "
                       f"top_logprobs {_short(req.top_logprobs)}", param="top_logprobs")
    if req.suffix:
        raise ApiError("suffix is not supported (must be empty or absent)", param="suffix")
    return req


def parse_chat(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a ``/v1/chat/completions`` body; raises `ApiError` (400) when it is invalid."""
    req: ChatCompletionRequest = _decode(_CHAT_DECODER, body)
    _check_common(req)
    _check_messages(req.messages)
    _check_max_tokens(req.max_tokens, "max_tokens")
    _check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    _check_sampling(req)
    _check_logprob_count(req.top_logprobs, "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.echo:
        raise ApiError("echo is not supported in chat completions (must be false or absent)", param="echo")
    return req


# ---------------------------------------------------------------------------------------------- validation


def _check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    """The rules both endpoints share; also normalizes a null `n`/`stream` to its default."""
    if req.n is None:
        req.n = 1
    if req.stream is None:
        req.stream = False
    if req.temperature is not None:
        _check_finite(req.temperature, "temperature")
        if not 0.0 <= req.temperature <= 2.0:
            raise ApiError(f"temperature must be between 0 and 2, got {req.temperature:g}", param="temperature")
    if req.top_p is not None:
        _check_finite(req.top_p, "top_p")
        if not 0.0 < req.top_p <= 1.0:
            raise ApiError(f"top_p must be in (0, 1], got {req.top_p:g}", param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(f"top_k must be -1 or 0 (off) or a positive integer, got {_short(req.top_k)}", param="top_k")
    if req.seed is not None and not SEED_MIN <= req.seed < SEED_END:
        raise ApiError(f"seed must be in [-2**63, 2**64), got {_short(req.seed)}", param="seed")
    _check_stop(req.stop)
    grammar_spec(req)  # structured output's fields (compiled later, when the request is served)
    for name, (neutral, wanted) in UNSUPPORTED.items():
        value = getattr(req, name)
        if value is not None and not neutral(value):
            raise ApiError(f"{name} is not supported ({wanted}), got {_short(value)}", param=name)
    if req.slo is not None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(req.slo, name)
            if value is not None:
                _check_finite(value, f"slo.{name}")
                if not 0.0 < value <= MAX_SLO_MS:
                    raise ApiError(
                        f"slo.{name} must be > 0 and <= {MAX_SLO_MS:.0f} milliseconds, got {value:g}",
                        param=f"slo.{name}",
                    )


def _is(neutral: object) -> Callable[[Any], bool]:
    """A test for `neutral` in JSON's sense: equal and of the same kind (1.0 is 1, but true is not 1)."""
    numeric = isinstance(neutral, (int, float)) and not isinstance(neutral, bool)

    def check(value: Any) -> bool:
        if isinstance(value, bool) or numeric:
            return isinstance(value, (int, float)) and isinstance(value, bool) == isinstance(neutral, bool) \
                and value == neutral
        return type(value) is type(neutral) and value == neutral

    return check


# Known features the gateway does not implement: field -> (is it neutral?, what is accepted). A value
# that is neither absent, null nor neutral is refused with a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (_is({}), "must be empty or absent"),
    "tools": (_is([]), "must be empty or absent"),
    "tool_choice": (_is("none"), 'must be "none" or absent'),
    "functions": (_is([]), "must be empty or absent"),
    "function_call": (_is("none"), 'must be "none" or absent'),
    "include_stop_str_in_output": (_is(False), "must be false or absent"),
    "use_beam_search": (_is(False), "must be false or absent"),
}


def _short(value: object, limit: int = 80) -> str:
    """A value for an error message, cut short (a client may send megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _check_finite(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise ApiError(f"{param} must be a finite number, got {value}", param=param)


def _check_sampling(req: CompletionRequest | ChatCompletionRequest) -> None:
    """n, best_of, the penalties, min_p, min_tokens and stop_token_ids within vLLM's limits (n capped)."""
    assert req.n is not None
    if not 1 <= req.n <= MAX_N:
        raise ApiError(f"n must be between 1 and {MAX_N}, got {_short(req.n)}", param="n")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(f"best_of must equal n ({req.n}): only best_of = n is supported (each choice is one "
                       f"generation), got {_short(req.best_of)}", param="best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            _check_finite(value, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ApiError(f"{name} must be between -2 and 2, got {value:g}", param=name)
    if req.repetition_penalty is not None:
        _check_finite(req.repetition_penalty, "repetition_penalty")
        if req.repetition_penalty <= 0:
            raise ApiError(f"repetition_penalty must be > 0, got {req.repetition_penalty:g}",
                           param="repetition_penalty")
    if req.min_p is not None:
        _check_finite(req.min_p, "min_p")
        if not 0.0 <= req.min_p <= 1.0:
            raise ApiError(f"min_p must be in [0, 1], got {req.min_p:g}", param="min_p")
    if req.min_tokens is not None:
        limit = _max_tokens_of(req)
        bound = f"max_tokens ({limit})" if limit is not None else str(MAX_TOKENS_LIMIT)
        if not 0 <= req.min_tokens <= (MAX_TOKENS_LIMIT if limit is None else limit):
            raise ApiError(f"min_tokens must be between 0 and {bound}, got {_short(req.min_tokens)}",
                           param="min_tokens")
    ids = req.stop_token_ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                       param="stop_token_ids")
    if any(t < 0 for t in ids):
        raise ApiError(f"stop_token_ids must be non-negative token ids, got {_short(min(ids))}", param="stop_token_ids")


def _max_tokens_of(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def _check_logprob_count(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(f"{param} must be between 0 and {MAX_LOGPROBS}, got {_short(value)}", param=param)


def _check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and not 1 <= value <= MAX_TOKENS_LIMIT:
        raise ApiError(f"{param} must be between 1 and {MAX_TOKENS_LIMIT}, got {value}", param=param)


def _check_stop(stop: str | list[str] | None) -> None:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(f"stop may hold at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise ApiError(f"each stop string may be at most {MAX_STOP_CHARS} characters, got {len(s)}", param="stop")


def _check_prompt(prompt: str | list) -> None:
    """One prompt: a non-empty string, a non-empty list of token ids, or a one-element list of either."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("prompt must not be empty", param="prompt")
        return
    if not prompt:
        raise ApiError("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        _check_token_ids(prompt)
        return
    if all(isinstance(x, str) for x in prompt) or all(isinstance(x, list) for x in prompt):
        if len(prompt) > 1:
            raise ApiError(f"batched prompts are not supported: send one prompt, got {len(prompt)}", param="prompt")
        _check_prompt(prompt[0])
        return
    raise ApiError("prompt must be a string, a list of token ids, or a one-element list of either", param="prompt")


def _check_token_ids(ids: list[int]) -> None:
    for token in ids:
        if token < 0:
            raise ApiError(f"token ids must be non-negative integers, got {token}", param="prompt")


def _check_messages(messages: list[ChatMessage]) -> None:
    if not messages:
        raise ApiError("messages must not be empty", param="messages")
    for i, msg in enumerate(messages):
        if msg.role not in CHAT_ROLES:
            raise ApiError(
                f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {msg.role!r}", param=f"messages[{i}].role"
            )
        param = f"messages[{i}].content"
        if msg.content is None:
            if msg.role != "assistant":
                raise ApiError(f"{param} may be null only for an assistant message", param=param)
        elif isinstance(msg.content, list):
            for j, part in enumerate(msg.content):
                if part.get("type") != "text":
                    raise ApiError(
                        f"{param}[{j}]: only text content parts are supported, got type {part.get('type')!r}",
                        param=param,
                    )
                if not isinstance(part.get("text"), str):
                    raise ApiError(f"{param}[{j}]: a text content part needs a string 'text'", param=param)
