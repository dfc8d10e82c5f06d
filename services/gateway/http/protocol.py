"""OpenAI request bodies: the msgspec Structs, `ApiError`, and their normalization.

The Structs are what ``POST /v1/completions`` and ``POST /v1/chat/completions`` decode into
(parse.py decodes and validates them). `sampling_of` reduces either request to one `Sampling`, a
field the request leaves out taken from the model's generation defaults (`SAMPLING_DEFAULTS` where
the model has none);
`prompt_of` and `messages_of` give the prompt in the forms the tokenizer and the chat template take.

Nullable fields: OpenAI documents most optional fields as "X or null", so an explicit ``null``
is accepted everywhere and means "absent". `n` and `stream` are typed ``X | None`` for that
reason but are normalized by the parse functions, so after parsing they are never None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from msgspec import Struct

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "SAMPLING_DEFAULTS",
    "Sampling",
    "SloSpec",
    "StreamOptions",
    "messages_of",
    "prompt_of",
    "sampling_of",
]

# What a request that leaves a field out gets when the model's files name no default for it (vLLM's and OpenAI's)
SAMPLING_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                                             "min_p": 0.0}
TOP_K_OFF_ABOVE = 2**31 - 1  # no vocabulary is larger: a top_k above it limits nothing and is sent as 0 (off)
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
    echo: bool | None = None  # completions: the prompt before the completion (chat refuses it)
    top_logprobs: int | None = None  # chat: ranked tokens per position with logprobs: true (completions refuse it)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's sampling extensions, with min_p, min_tokens, stop_token_ids
    min_p: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    best_of: int | None = None  # only best_of = n (each choice is one generation)
    # Known features the gateway does not implement: refused unless absent, null or neutral (UNSUPPORTED).
    logit_bias: dict[str, float] | None = None
    response_format: Any = None  # structured output, as the guided_* fields below (http/guided.py)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None  # the deprecated form of tools
    function_call: Any = None  # the deprecated form of tool_choice
    include_stop_str_in_output: Any = None  # vLLM's extensions from here on
    use_beam_search: Any = None
    guided_json: Any = None  # structured output (http/guided.py), not refused
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``. `prompt` is a string, a token-id list, or a one-element list of either.

    msgspec allows only one array type in a union, so `prompt` is declared as ``str | list[...]``
    with mixed elements; `parse.parse_completion` enforces that the list is one of the OpenAI forms
    ``list[str]``, ``list[int]`` or ``list[list[int]]``.
    """

    model: str
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; None = until the context is full
    logprobs: int | None = None  # null: none; N: each token's logprob and the N most likely tokens there
    # A known feature we do not implement: refused when it asks for anything.
    suffix: str | None = None  # refused unless null or empty


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``. `max_completion_tokens` wins over `max_tokens` when both are given."""

    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None  # each token's logprob, with `top_logprobs` ranked tokens


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
    min_p: float = 0.0  # [0, 1]; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    min_tokens: int = 0  # output tokens before EOS, a stop id or a stop string may end it
    stop_token_ids: tuple[int, ...] = ()  # more ids that end the output (kept in it, as vLLM does)
    n: int = 1  # choices, each its own generation
    logprobs: int | None = None  # None: none; N: each output token's logprob and the N most likely tokens there
    echo: bool = False  # completions: the prompt (with logprobs: and its tokens' logprobs) before the completion


# ---------------------------------------------------------------------------------------------- normalization


def sampling_of(req: CompletionRequest | ChatCompletionRequest,
                model_defaults: Mapping[str, float | int] | None = None) -> Sampling:
    """The normalized sampling parameters of a parsed (validated) request; a field of SAMPLING_DEFAULTS that
    it leaves out (absent or null) is `model_defaults`' value (the model's generation_config) if it has one."""
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    defaults = {**SAMPLING_DEFAULTS, **(model_defaults or {})}
    given = {name: getattr(req, name) for name in SAMPLING_DEFAULTS}
    value = {name: defaults[name] if v is None else v for name, v in given.items()}
    top_k = int(value["top_k"])
    return Sampling(
        temperature=float(value["temperature"]),
        top_p=float(value["top_p"]),
        top_k=top_k if 0 < top_k <= TOP_K_OFF_ABOVE else 0,
        seed=req.seed,
        max_tokens=max_tokens,
        stop=tuple(s for s in stops if s),
        ignore_eos=bool(req.ignore_eos),
        min_p=float(value["min_p"]),
        repetition_penalty=float(value["repetition_penalty"]),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        min_tokens=req.min_tokens or 0,
        stop_token_ids=tuple(dict.fromkeys(req.stop_token_ids or ())),
        n=req.n or 1,
        logprobs=logprobs,
        echo=bool(req.echo),
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
