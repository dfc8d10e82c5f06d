"""A property-based fuzz of the HTTP API: no body makes the server answer 500, hang or lose state.

One `specserve up` serves the module. Hypothesis generates batches of 1-4 bodies, sent to
/v1/completions and /v1/chat/completions at once (so valid ones are co-batched with each other
while junk arrives): OpenAI requests whose fields take random values of random types (valid,
extreme and wrong), random JSON, random bytes, mutated and truncated requests, deep nesting,
invalid UTF-8, surrogates and NaN literals, structured output's fields (schemas, regexes, choices and
grammars, valid and junk). Valid requests ask for 1-4 tokens so they finish fast.
Every answer must be 200 with a well-formed completion (JSON or SSE ending in [DONE], no error
event), or 400 / 413 / 503 with OpenAI's error body; never a 500, never a hang (a 60 s timeout).
Afterwards the server must give the same greedy text as before the fuzz, be healthy, and hold no
request and no KV block in either service.

Bounded: at most MAX_EXAMPLES batches and FUZZ_SECONDS of sending (checked per example), so the
module takes about two and a half minutes on 2 cores, startup included.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateway import PROMPTS, wait_all_free

MAX_EXAMPLES = 2000
FUZZ_SECONDS = 100.0
MAX_NEW = 4  # the most tokens a valid generated request asks for
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]
STATS: Counter = Counter()


@pytest.fixture(scope="module")
def send(up):
    """send([(path, body bytes), ...]) -> [(status, content type, body bytes)], all at once."""
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(base_url=up.url, timeout=60, limits=httpx.Limits(max_connections=16))

    async def post(path: str, body: bytes):
        resp = await client.post(path, content=body, headers={"content-type": "application/json"})
        return resp.status_code, resp.headers.get("content-type", ""), resp.content, dict(resp.headers)

    async def post_all(batch):
        return await asyncio.gather(*[post(path, body) for path, body in batch])

    yield lambda batch: loop.run_until_complete(post_all(batch))
    loop.run_until_complete(client.aclose())
    loop.close()


GREEDY_CHECK = {"model": "target", "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def before(send) -> str:
    (status, _, body, _), = send([("/v1/completions", json.dumps(GREEDY_CHECK).encode())])
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


# ---- strategies ---------------------------------------------------------------------------------
def mostly(good, bad, n: int = 3):
    return st.one_of(*([good] * n), bad)


wild_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),  # floats: NaN, Infinity too
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
small_text = st.text(max_size=40)
floats_near = st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 2, 1e-38, 5e-324, 1e-300, -0.0, -1e-9, 2.0000001,
                                                          1e30, 1e308, -1]), st.integers(-3, 5))
length = st.one_of(st.integers(1, MAX_NEW), st.integers(1, MAX_NEW),
                   st.sampled_from([0, -1, 10**7, 10**30, 1.5, "4", True, [4]]))
prompt = st.one_of(
    small_text, small_text,
    st.lists(st.integers(-3, 5000), max_size=16),
    st.lists(small_text, max_size=2),
    st.lists(st.lists(st.integers(0, 4200), max_size=8), max_size=2),
    wild_json,
)
content_part = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": small_text}), wild_json)
message = st.fixed_dictionaries({
    "role": mostly(st.sampled_from(["user", "system", "assistant", "developer"]),
                   st.one_of(st.sampled_from(["tool", "robot", ""]), wild_json)),
    "content": mostly(small_text, st.one_of(st.none(), st.lists(content_part, max_size=3), wild_json)),
})
# structured output: small schemas, regexes and grammars, valid and not
small_schema = st.sampled_from([
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]},
    {"type": "string", "maxLength": 3}, {"type": "boolean"}, {"enum": ["x", "y"]}, {},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, {"type": "foo"}, {"properties": 3}])
regex = st.one_of(st.sampled_from(["[a-z]{1,3}", "\\d{1,3}", "(yes|no)", "a(", "x[^\\s\\S]", "", "[z-a]"]),
                  st.text(alphabet="ab()[]{}|*+?.\\d019^$", max_size=8))
grammar = st.one_of(st.sampled_from(['root ::= "a" | "b"', "root ::= x", "root ::= [a-z]+", 'root ::= root "a"']),
                    small_text)
schema_format = st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
    {"name": small_text, "schema": st.one_of(small_schema, wild_json)}, optional={"strict": st.booleans()})})
FIELDS = {
    "temperature": floats_near,
    "top_p": st.one_of(st.floats(0, 1), st.sampled_from([1e-300, 5e-324, 1e-38, 0, 1, 1.5])),
    "top_k": st.one_of(st.integers(-3, 5000), st.sampled_from([10**30, 2**63, 2**64, -(2**63), 1e30])),
    "seed": st.integers(-(2**64), 2**65),
    "stop": st.one_of(st.none(), small_text, st.lists(small_text, max_size=20), st.text(min_size=250, max_size=300)),
    "stream": st.one_of(st.booleans(), st.none()),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": st.one_of(st.none(), st.integers(-1, 4), st.sampled_from([16, 17, 10**6])),
    "service_tier": st.one_of(st.none(), st.sampled_from(["critical", "search", "chat", "priority", "default", "auto",
                                                          "platinum", ""])),
    "slo": st.one_of(st.none(), st.fixed_dictionaries({}, optional={"tpot_ms": floats_near | st.floats(0, 1e7),
                                                                    "ttft_ms": floats_near | st.floats(0, 1e7)})),
    "ignore_eos": st.one_of(st.none(), st.booleans()),
    "user": small_text,
    "presence_penalty": st.one_of(st.floats(-2.5, 2.5), st.sampled_from([0, -2, 2, 2.0000001, 1e30, -1e308])),
    "frequency_penalty": st.one_of(st.floats(-2.5, 2.5), st.sampled_from([0, -2, 2, -2.0000001, 1e30])),
    "repetition_penalty": st.one_of(st.floats(-1, 3), st.sampled_from([0, -0.0, 1, 5e-324, 1e-300, 1e30, 1e308])),
    "logit_bias": st.one_of(st.just({}), st.dictionaries(st.text(max_size=4), st.floats(-100, 100), max_size=2)),
    "response_format": st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                                                  {"type": "yaml"}]), schema_format),
    "tools": st.one_of(st.just([]), st.lists(wild_json, min_size=1, max_size=2)),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "functions": st.one_of(st.just([]), st.lists(wild_json, min_size=1, max_size=2)),
    "function_call": st.sampled_from(["none", "auto"]),
    "best_of": st.integers(-1, 5),
    "echo": st.booleans(),
    "logprobs": st.one_of(st.booleans(), st.integers(-3, 25), st.sampled_from([20, 21, 1.5, "3", 10**30])),
    "top_logprobs": st.one_of(st.integers(-3, 25), st.sampled_from([20, 21, 2.0, True, 10**30])),
    "suffix": st.sampled_from(["", "x"]),
    "min_p": st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0, 1, 5e-324, 1.0000001])),
    "min_tokens": st.one_of(st.integers(-2, 2 * MAX_NEW), st.sampled_from([10**6, 10**30])),
    "stop_token_ids": st.one_of(st.just([]), st.lists(st.integers(-3, 5000), min_size=1, max_size=3),
                                st.lists(st.just(7), min_size=129, max_size=130), st.sampled_from([[2**64], [1.5]])),
    "guided_json": st.one_of(wild_json, small_schema, small_schema.map(json.dumps), small_text),
    "guided_regex": regex,
    "guided_choice": st.one_of(st.lists(small_text, max_size=4), wild_json),
    "guided_grammar": grammar,
    "some_future_field": wild_json,
}


@st.composite
def openai_body(draw) -> dict:
    chat = draw(st.booleans())
    body = {"model": draw(mostly(st.just("target"), wild_json))}
    if chat:
        body["messages"] = draw(mostly(st.lists(message, min_size=1, max_size=3), wild_json))
        body["max_tokens"] = draw(length)  # chat's default is "until the context is full": always bound it
        if draw(st.booleans()):
            body["max_completion_tokens"] = draw(st.one_of(length, st.none()))
    else:
        body["prompt"] = draw(prompt)
        body["max_tokens"] = draw(length)
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        body[name] = draw(mostly(FIELDS[name], wild_json, n=2))
    return body


VALID_FIELDS = {  # values the gateway accepts, extremes included
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 2, 1e-38, 5e-324, 1e-300])),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([1, 1e-300, 5e-324])),
    "top_k": st.one_of(st.integers(-1, 5000), st.sampled_from([10**30, 2**64])),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(st.none(), small_text, st.lists(small_text, max_size=16)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "service_tier": st.sampled_from(["critical", "search", "chat", "priority", "default", "auto"]),
    "slo": st.fixed_dictionaries({}, optional={"tpot_ms": st.floats(1e-300, 3.6e6), "ttft_ms": st.floats(1e-9, 3.6e6)}),
    "ignore_eos": st.booleans(),
    "user": small_text,
    "n": st.integers(1, 4),
    "best_of": st.just(1),  # made equal to n below
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.one_of(st.floats(0.01, 3), st.sampled_from([1, 5e-324, 1e-300, 1e30, 1e308])),
    "min_p": st.one_of(st.floats(0, 1), st.sampled_from([5e-324, 1])),
    "min_tokens": st.integers(0, MAX_NEW),  # at most max_tokens (below)
    "stop_token_ids": st.lists(st.integers(0, 4095), max_size=4),
    "response_format": st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}]), schema_format),
    "guided_regex": st.sampled_from(["[a-z]{1,3}", "\\d{1,3}", "(yes|no)", "x[^\\s\\S]"]),
    "guided_choice": st.lists(st.text(max_size=8), min_size=1, max_size=4),
    "guided_json": small_schema,
    "guided_grammar": st.sampled_from(['root ::= "a" | "b"', "root ::= [a-z]+"]),
    "tools": st.just([]),
    "tool_choice": st.just("none"),
    "some_future_field": wild_json,
}


@st.composite
def valid_body(draw) -> dict:
    body: dict = {"model": "target", "max_tokens": draw(st.integers(1, MAX_NEW))}
    if draw(st.booleans()):
        role = st.sampled_from(["user", "system", "developer", "assistant"])
        body["messages"] = draw(st.lists(st.fixed_dictionaries({"role": role, "content": small_text}),
                                         min_size=1, max_size=3))
    else:
        body["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=40),
                                        st.lists(st.integers(0, 4095), min_size=1, max_size=16)))
    names = draw(st.lists(st.sampled_from(sorted(VALID_FIELDS)), max_size=4, unique=True))
    guided = [n for n in names if n in GRAMMAR_FIELDS]
    for name in [n for n in names if n not in GRAMMAR_FIELDS] + guided[:1]:  # one grammar at most
        body[name] = draw(VALID_FIELDS[name])
    if draw(st.booleans()):  # logprobs: completions' count and echo, chat's flag and count
        if "messages" in body:
            body["logprobs"] = draw(st.booleans())
            if body["logprobs"] and draw(st.booleans()):
                body["top_logprobs"] = draw(st.integers(0, 20))
        else:
            body["logprobs"] = draw(st.one_of(st.none(), st.integers(0, 20)))
            body["echo"] = draw(st.booleans())
    if "best_of" in body:
        body["best_of"] = body.get("n", 1)
    if "min_tokens" in body:
        body["min_tokens"] = min(body["min_tokens"], body["max_tokens"])
    return body


GRAMMAR_FIELDS = ("response_format", "guided_regex", "guided_choice", "guided_json", "guided_grammar")


def to_bytes(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN and Infinity become NaN / Infinity literals (not JSON)


@st.composite
def mutated(draw) -> bytes:
    raw = to_bytes(draw(openai_body()))
    how = draw(st.sampled_from(["truncate", "insert", "replace", "string_bytes", "escape"]))
    at = draw(st.integers(0, len(raw)))
    if how == "truncate":
        return raw[:at]
    if how == "insert":
        return raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:]
    if how == "replace":
        return raw[:at] + draw(st.binary(min_size=1, max_size=1)) + raw[at + 1 :]
    junk = draw(st.binary(min_size=1, max_size=12)) if how == "string_bytes" else draw(
        st.sampled_from([b"\\ud800", b"\\udfff\\ud800", b"\\ud83d\\ude00", b"\\u0000", b"\xed\xa0\x80", b"\\x41",
                         b"\\", b"\\u12"]))
    return b'{"model": "target", "max_tokens": 2, "prompt": "a' + junk + b'"}'


@st.composite
def deeply_nested(draw) -> bytes:
    depth = draw(st.integers(50, 20_000))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a": ', b"}")]))
    field = draw(st.sampled_from(["prompt", "messages", "stop", "slo", "tools", "logit_bias", "junk"]))
    return (b'{"model": "target", "max_tokens": 1, "prompt": "x", "' + field.encode() + b'": '
            + opener * depth + b"1" + closer * depth + b"}")


def routed(body: dict) -> tuple[str, bytes]:
    return ("/v1/chat/completions" if "messages" in body else "/v1/completions"), to_bytes(body)


junk = st.one_of(
    openai_body().map(to_bytes), openai_body().map(to_bytes),
    wild_json.map(to_bytes),
    st.binary(max_size=200),
    mutated(),
    deeply_nested(),
    st.sampled_from([b"", b" ", b"null", b"[]", b"{}", b"1e999999", b"-0", b'"x"', b"\xef\xbb\xbf{}", b"{" * 3]),
)
requests = st.one_of(valid_body().map(routed), st.tuples(st.sampled_from(ENDPOINTS), junk),
                     st.tuples(st.sampled_from(ENDPOINTS), junk))
batches = st.lists(requests, min_size=1, max_size=4)


# ---- checks -------------------------------------------------------------------------------------
def most_tokens(path: str, sent: bytes) -> int | None:
    """The most completion tokens a body that was served may get: what it asked for (per choice, n of
    them), else the API's default (16 for a completion; chat's is "until the context is full": None, no
    bound). A mutated body can lose its `max_tokens` (renamed, say) and still be valid."""
    body = json.loads(sent)
    asked = [body.get(k) for k in (("max_completion_tokens", "max_tokens") if "chat" in path else ("max_tokens",))]
    asked = [v for v in asked if v is not None]
    if asked:
        return int(asked[0]) * choices_of(sent)
    return None if "chat" in path else 16 * choices_of(sent)


def choices_of(sent: bytes) -> int:
    """How many choices a body that was served asked for (n, 1 when absent or null)."""
    return json.loads(sent).get("n") or 1


def check(status: int, ctype: str, body: bytes, headers: dict, path: str, sent: bytes) -> None:
    where = f"{status} for {path} {sent[:300]!r}: {body[:500]!r}"
    assert status in (200, 400, 413, 503), where
    if status != 200:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), where
        assert err["message"] and err["type"] == ("invalid_request_error" if status < 500 else "service_unavailable")
        assert err["param"] is None or isinstance(err["param"], str), where
        if status == 503:
            assert "retry-after" in {k.lower() for k in headers}, where
        return
    if ctype.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in body.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", where
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), where
        finishes: dict[int, list] = {}  # per choice index, its chunks' finish reasons in order
        for c in chunks:
            for choice in c.get("choices") or []:
                check_logprobs(choice.get("logprobs"), c["object"] == "chat.completion.chunk", where)
                finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
        assert sorted(finishes) == list(range(choices_of(sent))), where
        for f in finishes.values():
            assert f[-1] in ("stop", "length") and all(x is None for x in f[:-1]), where
        usage = [c["usage"] for c in chunks if "usage" in c]
        bound = most_tokens(path, sent)
        assert all(bound is None or u["completion_tokens"] <= bound for u in usage), where
        return
    assert ctype.startswith("application/json"), where
    out = json.loads(body)
    assert out["object"] in ("text_completion", "chat.completion"), where
    assert [c["index"] for c in out["choices"]] == list(range(choices_of(sent))), where
    for choice in out["choices"]:
        check_logprobs(choice.get("logprobs"), out["object"] == "chat.completion", where)
        assert choice["finish_reason"] in ("stop", "length"), where
        text = choice["text"] if out["object"] == "text_completion" else choice["message"]["content"]
        assert isinstance(text, str), where
    bound = most_tokens(path, sent)
    assert bound is None or out["usage"]["completion_tokens"] <= bound, where


def check_logprobs(lp, chat: bool, where: str) -> None:
    """A choice's `logprobs`, when present, in OpenAI's shape."""
    if lp is None:
        return
    if chat:
        assert isinstance(lp["content"], list), where
        for entry in lp["content"]:
            assert {"token", "logprob", "bytes", "top_logprobs"} <= set(entry), where
            assert isinstance(entry["logprob"], float) and isinstance(entry["bytes"], list), where
        return
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    assert len({len(lp[f]) for f in fields}) == 1, where
    assert lp["text_offset"] == sorted(lp["text_offset"]), where
    assert all(v is None or isinstance(v, float) for v in lp["token_logprobs"]), where


@pytest.fixture(scope="module")
def deadline() -> float:
    return time.monotonic() + FUZZ_SECONDS


@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(batch=batches)
def test_fuzz_http_api(up, send, before, deadline, batch):
    if time.monotonic() > deadline and not STATS["failures"]:  # once one failed, hypothesis shrinks it
        STATS["skipped_after_deadline"] += 1
        return
    started = time.monotonic()
    try:
        for (path, sent), (status, ctype, body, headers) in zip(batch, send(batch)):
            STATS[status] += 1
            STATS["bodies"] += 1
            check(status, ctype, body, headers, path, sent)
    except BaseException:
        STATS["failures"] += 1
        raise
    STATS["batches"] += 1
    STATS["seconds"] += time.monotonic() - started


def test_server_unharmed_after_fuzz(up, send, before):
    print(f"fuzz: {dict(STATS)}")
    assert STATS["bodies"] >= 1000 and STATS[200] >= 300 and STATS[400] >= 500, STATS
    (status, _, body, _), = send([("/v1/completions", json.dumps(GREEDY_CHECK).encode())])
    assert status == 200 and json.loads(body)["choices"][0]["text"] == before
    health = httpx.get(f"{up.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["draft"] is True
    wait_all_free(up)
