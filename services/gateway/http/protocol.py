"""OpenAI request bodies: parsing with msgspec, validation, and normalization.

`parse_completion` and `parse_chat` turn the JSON body of ``POST /v1/completions`` and
``POST /v1/chat/completions`` into Structs and validate every field the gateway acts on; anything
invalid raises `ApiError`, which the server turns into an HTTP response in OpenAI's error shape.
Fields the gateway does not know are ignored (clients send many), but a known feature the gateway
does not implement (n > 1, best_of, echo, logprobs, suffix, penalties, logit bias, response formats,
tools and function calls, vLLM's min_p / min_tokens / stop_token_ids / guided decoding, ...) is
refused with a 400 naming it unless it is absent, null or its neutral value (`UNSUPPORTED`), rather
than silently dropped. Every malformed body (not UTF-8, not JSON, nested too deep, a wrong type
anywhere) is a 400 too, never an exception out of this module. `sampling_of` reduces either
request to one `Sampling`; `prompt_of` and `messages_of` give the prompt in the forms the
tokenizer and the chat template take.

Nullable fields: OpenAI documents most optional fields as "X or null", so an explicit ``null``
is accepted everywhere and means "absent". `n` and `stream` are typed ``X | None`` for that
reason but are normalized by the parse functions, so after parsing they are never None.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import Struct

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Sampling",
    "SloSpec",
    "StreamOptions",
    "messages_of",
    "parse_chat",
    "parse_completion",
    "prompt_of",
    "sampling_of",
]

MAX_TOKENS_LIMIT = 1_000_000  # absurd values are refused here; the server checks the context length
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_SLO_MS = 3_600_000.0
SEED_MIN, SEED_END = -(2**63), 2**64  # seed in [SEED_MIN, SEED_END)
TOP_K_OFF_ABOVE = 2**31 - 1  # no vocabulary is larger: a top_k above it limits nothing and is sent as 0 (off)
CHAT_ROLES = frozenset({"system", "user", "assistant", "developer"})
CONTENT_PART_JOINER = "\n"  # text parts of one message are joined as vLLM does


class ApiError(Exception):
    """A request the gateway refuses; `body()` is OpenAI's error object, `status` the HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r})"


class SloSpec(Struct, forbid_unknown_fields=True):
    """Our extension (sent through the client's ``extra_body`` as ``"slo"``): per-request latency targets."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    best_effort: bool | None = None  # may be served without an SLO when none can be met (default: service_tier flex)


class StreamOptions(Struct):
    include_usage: bool = False


class ChatMessage(Struct):
    """One chat message; `content` as a list is OpenAI content parts, of which only text parts are accepted."""

    role: str
    content: str | list[dict[str, Any]] | None = None


class _SamplingFields(Struct, kw_only=True):
    """The fields both endpoints share (sampling, streaming, the SLO)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    service_tier: str | None = None
    slo: SloSpec | None = None
    ignore_eos: bool | None = None  # vLLM's extension: keep generating past EOS (benchmarks use it)
    user: str | None = None  # metadata: accepted and not used
    # Known features the gateway does not implement: refused unless absent, null or neutral (UNSUPPORTED).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    echo: bool | None = None  # a completions field; vLLM's chat has it too
    top_logprobs: int | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None  # the deprecated form of tools
    function_call: Any = None  # the deprecated form of tool_choice
    min_p: Any = None  # vLLM's sampling extensions from here on
    min_tokens: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    use_beam_search: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``. `prompt` is a string, a token-id list, or a one-element list of either.

    msgspec allows only one array type in a union, so `prompt` is declared as ``str | list[...]``
    with mixed elements; `parse_completion` enforces that the list is one of the OpenAI forms
    ``list[str]``, ``list[int]`` or ``list[list[int]]``.
    """

    model: str
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; None = until the context is full
    # Known features we do not implement: refused when they ask for anything.
    logprobs: int | None = None  # refused unless null (0 asks for the chosen token's logprob)
    suffix: str | None = None  # refused unless null or empty


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``. `max_completion_tokens` wins over `max_tokens` when both are given."""

    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # Known features we do not implement: refused when they ask for anything.
    logprobs: bool | None = None


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling parameters of a request, normalized the same way for both endpoints."""

    temperature: float  # 0 = greedy; 1.0 when absent (OpenAI's default)
    top_p: float  # (0, 1]; 1.0 when absent
    top_k: int  # 0 = off (-1, vLLM's "off", and values above TOP_K_OFF_ABOVE are normalized to 0)
    seed: int | None
    max_tokens: int | None  # None = until the context is full (the server fills it in)
    stop: tuple[str, ...]  # empty strings dropped
    ignore_eos: bool = False  # EOS tokens do not end the output (they are generated like any token)


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
    if req.logprobs is not None:
        raise ApiError("logprobs are not supported", param="logprobs")
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
    if req.logprobs:
        raise ApiError("logprobs are not supported", param="logprobs")
    return req


# ---------------------------------------------------------------------------------------------- validation


def _check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    """The rules both endpoints share; also normalizes a null `n`/`stream` to its default."""
    if req.n is None:
        req.n = 1
    if req.stream is None:
        req.stream = False
    if req.n != 1:
        raise ApiError(f"n > 1 is not supported (n must be 1), got {req.n}", param="n")
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
    "presence_penalty": (_is(0), "must be 0 or absent"),
    "frequency_penalty": (_is(0), "must be 0 or absent"),
    "repetition_penalty": (_is(1), "must be 1 or absent"),
    "logit_bias": (_is({}), "must be empty or absent"),
    "best_of": (_is(1), "must be 1 or absent"),
    "echo": (_is(False), "must be false or absent"),
    "top_logprobs": (_is(0), "must be 0 or absent"),
    "response_format": (_is({"type": "text"}), 'must be {"type": "text"} or absent'),
    "tools": (_is([]), "must be empty or absent"),
    "tool_choice": (_is("none"), 'must be "none" or absent'),
    "functions": (_is([]), "must be empty or absent"),
    "function_call": (_is("none"), 'must be "none" or absent'),
    "min_p": (_is(0), "must be 0 or absent"),
    "min_tokens": (_is(0), "must be 0 or absent"),
    "stop_token_ids": (_is([]), "must be empty or absent; use stop strings"),
    "include_stop_str_in_output": (_is(False), "must be false or absent"),
    "use_beam_search": (_is(False), "must be false or absent"),
    "guided_json": (lambda v: False, "must be absent"),
    "guided_regex": (lambda v: False, "must be absent"),
    "guided_choice": (lambda v: False, "must be absent"),
    "guided_grammar": (lambda v: False, "must be absent"),
}


def _short(value: object, limit: int = 80) -> str:
    """A value for an error message, cut short (a client may send megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _check_finite(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise ApiError(f"{param} must be a finite number, got {value}", param=param)


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


# ---------------------------------------------------------------------------------------------- normalization


def sampling_of(req: CompletionRequest | ChatCompletionRequest) -> Sampling:
    """The normalized sampling parameters of a parsed (validated) request."""
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        max_tokens = req.max_tokens
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return Sampling(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=0 if req.top_k is None or not 0 < req.top_k <= TOP_K_OFF_ABOVE else req.top_k,
        seed=req.seed,
        max_tokens=max_tokens,
        stop=tuple(s for s in stops if s),
        ignore_eos=bool(req.ignore_eos),
    )


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a parsed completion request: text, or token ids (a one-element list unwrapped)."""
    prompt: object = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    return prompt  # type: ignore[return-value]  # validated (_check_prompt): str or list[int]


def messages_of(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` dicts of strings for the chat template (text parts joined)."""
    out = []
    for msg in req.messages:
        if msg.content is None:
            content = ""
        elif isinstance(msg.content, str):
            content = msg.content
        else:
            content = CONTENT_PART_JOINER.join(part["text"] for part in msg.content)
        out.append({"role": msg.role, "content": content})
    return out
