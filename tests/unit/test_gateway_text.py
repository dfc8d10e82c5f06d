"""The gateway's text layer: OpenAI request validation, incremental detokenization, stop strings."""

from __future__ import annotations

import copy
import itertools
import json
import random
from pathlib import Path

import msgspec
import pytest

from specserve.gateway.http.detokenize import IncrementalDetokenizer, StopMatcher
from specserve.gateway.http.parse import parse_chat, parse_completion
from specserve.gateway.http.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Sampling,
    messages_of,
    prompt_of,
    sampling_of,
)
from specserve.gateway.http.server import framed

TARGET = Path(__file__).resolve().parents[2] / "models" / "target"

# ---------------------------------------------------------------------------------------------- protocol


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "Hello", **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}).encode()


def refused(parse, body: bytes, param: str | None) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert err.status == 400
    assert err.param == param, err.message
    assert err.body() == {
        "error": {"message": err.message, "type": "invalid_request_error", "param": param, "code": None}
    }
    return err


def test_minimal_requests_and_defaults():
    req = parse_completion(completion())
    assert isinstance(req, CompletionRequest)
    assert (req.model, req.prompt, req.max_tokens, req.stream, req.n) == ("m", "Hello", 16, False, 1)
    assert sampling_of(req) == Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=None, max_tokens=16, stop=())
    creq = parse_chat(chat())
    assert isinstance(creq, ChatCompletionRequest)
    assert sampling_of(creq) == Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=None, max_tokens=None, stop=())
    assert messages_of(creq) == [{"role": "user", "content": "Hi"}]


def test_full_request_normalized():
    body = completion(
        temperature=0,
        top_p=0.5,
        top_k=-1,
        seed=7,
        max_tokens=None,
        stop=["", "\n\n", "END"],
        stream=True,
        stream_options={"include_usage": True},
        service_tier="interactive",
        slo={"ttft_ms": 200, "tpot_ms": 20.5},
        user="u1",
        logit_bias=None,
        suffix=None,
        echo=False,
        best_of=1,
        presence_penalty=0,
        frequency_penalty=0.0,
        n=None,
        some_future_field={"x": 1},
    )
    req = parse_completion(body)
    assert req.stream is True and req.stream_options.include_usage is True and req.n == 1
    assert req.service_tier == "interactive"
    assert (req.slo.ttft_ms, req.slo.tpot_ms) == (200.0, 20.5)
    assert sampling_of(req) == Sampling(
        temperature=0.0, top_p=0.5, top_k=0, seed=7, max_tokens=None, stop=("\n\n", "END")
    )
    assert sampling_of(parse_completion(completion(top_k=40, stop="x", stream=None))).top_k == 40
    assert sampling_of(parse_completion(completion(stop="x"))).stop == ("x",)
    assert parse_completion(completion(stream=None)).stream is False


def test_chat_max_completion_tokens_wins():
    assert sampling_of(parse_chat(chat(max_tokens=5))).max_tokens == 5
    assert sampling_of(parse_chat(chat(max_completion_tokens=9))).max_tokens == 9
    assert sampling_of(parse_chat(chat(max_tokens=5, max_completion_tokens=9))).max_tokens == 9


@pytest.mark.parametrize(
    "body", [b"", b"  \n", b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"model": "m", "prompt": NaN}']
)
def test_malformed_bodies(body):
    refused(parse_completion, body, None)
    refused(parse_chat, body, None)


def test_type_errors_name_the_field():
    refused(parse_completion, b'{"prompt": "x"}', "model")
    refused(parse_completion, b'{"model": "m"}', "prompt")
    refused(parse_completion, completion(model=3), "model")
    refused(parse_completion, completion(temperature="hot"), "temperature")
    refused(parse_completion, completion(max_tokens=1.5), "max_tokens")
    refused(parse_completion, completion(stream="yes"), "stream")
    refused(parse_completion, completion(prompt=[1, 2.5]), "prompt[1]")
    refused(parse_completion, b'{"model": "m", "prompt": "x", "temperature": 1e999}', "temperature")
    refused(parse_chat, b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role")
    refused(parse_chat, chat(messages="hi"), "messages")
    refused(parse_chat, chat(slo={"ttft_ms": 100, "deadline": 3}), "slo")
    err = refused(parse_completion, completion(seed=True), "seed")
    assert "Expected `int | null`, got `bool`" in err.message


@pytest.mark.parametrize(
    ("field", "good", "bad"),
    [
        ("n", 16, 17),
        ("n", 1, 0),
        ("temperature", 2, 2.01),
        ("temperature", 0, -0.1),
        ("top_p", 1, 1.5),
        ("top_p", 1e-9, 0),
        ("top_k", -1, -2),
        ("seed", -(2**63), -(2**63) - 1),
        ("seed", 2**64 - 1, 2**64),
        ("max_tokens", 1, 0),
        ("max_tokens", 1_000_000, 1_000_001),
        ("stop", ["s"] * 16, ["s"] * 17),
        ("stop", "x" * 256, "x" * 257),
        ("stop", ["a", "x" * 256], ["a", "x" * 257]),
        ("presence_penalty", 2, 2.01),
        ("frequency_penalty", -2, -2.5),
        ("repetition_penalty", 1e-9, 0),
        ("min_p", 1, 1.01),
        ("min_p", 0, -0.1),
        ("min_tokens", 0, -1),
        ("stop_token_ids", [0] * 128, [0] * 129),
        ("stop_token_ids", [0, 7], [7, -1]),
        ("logit_bias", {}, {"50256": -100}),
    ],
)
def test_common_rules(field, good, bad):
    for parse, make in ((parse_completion, completion), (parse_chat, chat)):
        parse(make(**{field: good}))
        refused(parse, make(**{field: bad}), field)


def test_common_rule_messages():
    assert refused(parse_completion, completion(temperature=5), "temperature").message == (
        "temperature must be between 0 and 2, got 5"
    )
    assert refused(parse_chat, chat(n=17), "n").message == "n must be between 1 and 16, got 17"


@pytest.mark.parametrize(
    ("field", "good", "bad"), [("logprobs", 20, 21), ("logprobs", 0, -1), ("top_logprobs", 0, 2)],
)
def test_completion_only_rules(field, good, bad):
    parse_completion(completion(**{field: good}))
    refused(parse_completion, completion(**{field: bad}), field)


@pytest.mark.parametrize(
    ("field", "good", "bad"),
    [("echo", False, True), ("top_logprobs", 0, 2), ("max_completion_tokens", 1_000_000, 0)],
)
def test_chat_only_rules(field, good, bad):
    parse_chat(chat(**{field: good}))
    refused(parse_chat, chat(**{field: bad}), field)


@pytest.mark.parametrize(
    ("field", "good", "bad"),
    [("ttft_ms", 3_600_000, 3_600_001), ("ttft_ms", 0.001, 0), ("tpot_ms", 1, -5)],
)
def test_slo_rules(field, good, bad):
    assert getattr(parse_chat(chat(slo={field: good})).slo, field) == good
    refused(parse_chat, chat(slo={field: bad}), f"slo.{field}")
    refused(parse_completion, completion(slo={field: bad}), f"slo.{field}")


def test_non_finite_floats_refused_when_constructed_directly():
    # JSON cannot carry NaN/inf (msgspec refuses them above); the check also guards Structs built in code.
    from specserve.gateway.http import parse

    for value in (float("nan"), float("inf")):
        with pytest.raises(ApiError) as info:
            parse._check_common(CompletionRequest(model="m", prompt="x", top_p=value))
        assert info.value.param == "top_p"


_DEEP = b"[" * 5000 + b"]" * 5000


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": "\xff\xfe", "messages": "\xc3("}',  # invalid UTF-8 inside strings
        b'{"model": "m", "prompt": "x", "user": "\xc3("}',  # ... in a field the gateway does not act on
        b'{"model": "m", "prompt": "x", "junk": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8
        b'{"model": "m", "prompt": "a\\ud800b", "messages": "\\udc00"}',  # unpaired surrogate escapes
        b'{"model": "m", "prompt": "x", "junk": "\\ud800"}',
        b'{"model": "m", "prompt": ' + _DEEP + b', "messages": ' + _DEEP + b"}",  # nested 5,000 deep
        b'{"model": "m", "prompt": "x", "junk": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}",
        b'{"model": "m", "prompt": "x", "response_format": ' + _DEEP + b"}",
        b"[" * 100_000,
        b"null",
        b"true",
        b"1e999",
        b'"a string"',
        b"\xef\xbb\xbf{}",  # a byte order mark
        b'{"model": "m", "prompt": "x"} trailing',
        b'{"model": "m", "prompt": "x", "temperature": Infinity}',
        b'{"model": "m", "prompt": "x", "temperature": -Infinity}',
        b'{"model": "m", "prompt": "x", "max_tokens": 1e400, "max_completion_tokens": 1e400}',
        b'{"model": "m", "prompt": "x", "seed": 123456789012345678901234567890}',
        b'{"model": "m", "prompt": "x", "n": 123456789012345678901234567890}',
    ],
)
def test_malformed_bodies_of_any_kind_are_400(body):
    for parse in (parse_completion, parse_chat):
        with pytest.raises(ApiError) as info:
            parse(body)
        err = info.value
        assert err.status == 400 and err.body()["error"]["type"] == "invalid_request_error", err
        assert err.param is None or isinstance(err.param, str)


def test_duplicate_keys_last_one_wins_and_is_validated():
    assert parse_completion(b'{"model": "m", "prompt": "x", "temperature": 5, "temperature": 0}').temperature == 0
    refused(parse_completion, b'{"model": "m", "prompt": "x", "temperature": 0, "temperature": 5}', "temperature")


@pytest.mark.parametrize(
    ("field", "neutral", "bad"),
    [
        ("logit_bias", [{}], [{"50256": -100}]),
        ("tools", [[]], [[{"type": "function", "function": {"name": "f"}}], {}, 1e30]),
        ("tool_choice", ["none"], ["auto", "required", {"type": "function", "function": {"name": "f"}}]),
        ("functions", [[]], [[{"name": "f"}]]),
        ("function_call", ["none"], ["auto", {"name": "f"}]),
        ("include_stop_str_in_output", [False], [True, 0]),
        ("use_beam_search", [False], [True]),
    ],
)
def test_unsupported_features_refused_unless_neutral(field, neutral, bad):
    """Nothing is silently ignored: absent, null or the neutral value pass; anything else is a 400 naming it."""
    for parse, make in ((parse_completion, completion), (parse_chat, chat)):
        for value in [None, *neutral]:
            parse(make(**{field: value}))
        for value in bad:
            err = refused(parse, make(**{field: value}), field)
            assert f"{field} is not supported" in err.message


def test_completion_suffix_refused():
    parse_completion(completion(suffix=""))
    refused(parse_completion, completion(suffix="x"), "suffix")


def test_logprob_fields():
    """Completions: logprobs 0..20 and echo; chat: logprobs true with top_logprobs 0..20. Out of range, the
    wrong type, or top_logprobs without logprobs: a 400 naming the field."""
    for n in (0, 5, 20):
        assert sampling_of(parse_completion(completion(logprobs=n, echo=True))) == Sampling(
            1.0, 1.0, 0, None, 16, (), logprobs=n, echo=True)
        assert sampling_of(parse_chat(chat(logprobs=True, top_logprobs=n))).logprobs == n
    assert sampling_of(parse_completion(completion(echo=True))).logprobs is None
    assert sampling_of(parse_chat(chat(logprobs=True))).logprobs == 0
    assert sampling_of(parse_chat(chat(logprobs=False, top_logprobs=0))).logprobs is None
    for value in (21, -1, True, 1.5, "3", [1]):
        refused(parse_completion, completion(logprobs=value), "logprobs")
        refused(parse_chat, chat(logprobs=True, top_logprobs=value), "top_logprobs")
    for value in (1, "true", [True]):
        refused(parse_chat, chat(logprobs=value), "logprobs")
    refused(parse_completion, completion(echo=1), "echo")
    assert "needs logprobs" in refused(parse_chat, chat(top_logprobs=3), "top_logprobs").message
    assert "between 0 and 20" in refused(parse_completion, completion(logprobs=21), "logprobs").message


def test_top_k_beyond_any_vocabulary_is_no_limit_and_user_is_metadata():
    assert sampling_of(parse_completion(completion(top_k=4096))).top_k == 4096  # the sampler clamps to V
    assert sampling_of(parse_completion(completion(top_k=2**31 - 1))).top_k == 2**31 - 1
    for huge in (2**31, 2**64, 10**30):  # more than any vocabulary, and more than msgpack carries
        assert sampling_of(parse_completion(completion(top_k=huge))).top_k == 0
    assert sampling_of(parse_chat(chat(top_k=10**30))).top_k == 0
    refused(parse_completion, completion(top_k=1e30), "top_k")  # an integer, not a float
    parse_completion(completion(user="someone"))
    refused(parse_completion, completion(user=5), "user")


def test_extreme_sampling_values_pass_validation():
    """They pass because the sampler takes them (tests/unit/test_sampling_robust.py)."""
    for fields in ({"temperature": 1e-38}, {"temperature": 5e-324}, {"top_p": 1e-300}, {"top_p": 5e-324}):
        sampling = sampling_of(parse_completion(completion(**fields)))
        assert (sampling.temperature, sampling.top_p) == (fields.get("temperature", 1.0), fields.get("top_p", 1.0))


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("Hi", "Hi"), (["Hi"], "Hi"), ([5, 0, 7], [5, 0, 7]), ([[5, 6]], [5, 6]), ([7], [7])],
)
def test_prompt_forms(prompt, expected):
    assert prompt_of(parse_completion(completion(prompt=prompt))) == expected


@pytest.mark.parametrize(
    "prompt", ["", [], [""], [[]], ["a", "b"], [[1], [2]], [1, -1], [[3, -2]], [1, "a"], ["a", [1]], [[1], 2]]
)
def test_bad_prompts(prompt):
    refused(parse_completion, completion(prompt=prompt), "prompt")


def test_chat_messages():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": ""},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": []},
    ]
    assert messages_of(parse_chat(chat(messages=messages))) == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": ""},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""},
    ]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "tool", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}], "messages[1].role"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "system"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
    ],
)
def test_bad_messages(messages, param):
    refused(parse_chat, chat(messages=messages), param)


# ---------------------------------------------------------------------------------------------- detokenizer


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TARGET))


def stream(tokenizer, prompt, output, skip, rng) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces, i = [], 0
    while i < len(output):
        n = rng.randint(1, 5)
        pieces.append(detok.add(output[i : i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces


TEXTS = [
    "Héllo wörld, naïve café — déjà vu.",
    "世界你好，今天天气很好。日本語のテキスト",
    "emoji 🎉🚀 family 👨‍👩‍👧 flags 🇫🇷 done",
    "  leading spaces\n\n\tand tabs  ",
    "mixed: Ωμέγα Привет مرحبا שלום 한국어 ✓ ∑ ≠ €",
]


def test_detokenizer_matches_decode_on_text(tokenizer):
    rng = random.Random(0)
    special = list(range(5))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert max(ids) < len(tokenizer)
        for trial in range(20):
            out = list(ids)
            for _ in range(trial % 4):  # sprinkle special tokens, sometimes between a character's bytes
                out.insert(rng.randrange(len(out) + 1), rng.choice(special))
            prompt = tokenizer.encode(rng.choice(TEXTS))[: rng.randint(0, 12)]
            for skip in (True, False):
                pieces = stream(tokenizer, prompt, out, skip, rng)
                expected = tokenizer.decode(out, skip_special_tokens=skip)
                assert "".join(pieces) == expected
                if skip or trial % 4 == 0:  # valid UTF-8 throughout: no replacement character ever leaks
                    assert "\ufffd" not in expected
                    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_matches_decode_on_random_ids(tokenizer):
    rng = random.Random(1)
    vocab = len(tokenizer)
    for _ in range(300):
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.5:  # bias towards the byte tokens and the specials
            output = [rng.randrange(260) for _ in output]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]  # may end inside a character
        for skip in (True, False):
            pieces = stream(tokenizer, prompt, output, skip, rng)
            assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=skip)


def test_detokenizer_calls_the_rust_decode_only_where_it_is_what_decode_does(tokenizer):
    """The bundled tokenizer's decode is the Rust tokenizer's (the tests above check the text through
    that path); a tokenizer class that overrides decode keeps its own."""
    assert IncrementalDetokenizer(tokenizer, [])._backend_decode is not None

    class Shouting(type(tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    detok = IncrementalDetokenizer(shouting, [])
    assert detok._backend_decode is None
    assert detok.add(tokenizer.encode("hello world")) + detok.flush() == "HELLO WORLD"


def test_sse_piece_framing_gives_the_bytes_of_the_whole_event():
    """server.framed: the event around a text piece encoded once; every piece gives the bytes the whole
    event's encoding gives, and a marker that is not unique in the event falls back to encoding it whole."""
    enc = msgspec.json.Encoder()
    marker = "\x00specserve-piece\x00"
    pieces = [*TEXTS, "", " ", '"quoted"', "back\\slash", marker, "\u2028\u2029", "\x7f\x1f"]
    for model in ("demo", f'odd "model" {marker}', marker):
        base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model}
        for chat in (False, True):
            def whole(text: str, chat: bool = chat, base: dict = base) -> bytes:
                choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None} if chat \
                    else {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
                return b"data: " + enc.encode({**base, "choices": [choice]}) + b"\n\n"

            fast = framed(whole)
            assert (fast is whole) == (model == marker)  # the marker twice in the event: no template
            for piece in pieces:
                assert fast(piece) == whole(piece)


def test_detokenizer_emits_each_character_when_complete(tokenizer):
    ids = tokenizer.encode("a世b")
    assert len(ids) == 5  # 'a', three byte tokens of 世, 'b'
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    assert [detok.add([t]) for t in ids] == ["a", "", "", "世", "b"]
    assert detok.flush() == ""
    # An incomplete character at the end is given up by flush, as decode would show it.
    detok = IncrementalDetokenizer(tokenizer, [])
    assert (detok.add(ids[:1]), detok.add(ids[1:3])) == ("a", "")
    assert detok.flush() == "\ufffd"
    # A chunk ending inside a character is withheld whole (offsets move at token granularity).
    detok = IncrementalDetokenizer(tokenizer, [])
    assert (detok.add(ids[:2]), detok.add(ids[2:4]), detok.flush()) == ("", "a世", "")
    # Special tokens: skipped or kept.
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert (detok.add([eos]), detok.add(ids[:1]), detok.flush()) == ("", "a", "")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert (detok.add([eos]), detok.add(ids[:1]), detok.flush()) == ("<|endoftext|>", "a", "")


def test_detokenizer_prompt_ending_inside_a_character(tokenizer):
    # A token-id prompt may end with the first byte of 世; the output's bytes cannot complete it
    # (decode(output_ids) shows them as replacement characters), so the prompt is not used as context.
    ids = tokenizer.encode("a世b")
    output = ids[2:]
    assert tokenizer.decode(output) == "\ufffd\ufffdb"
    detok = IncrementalDetokenizer(tokenizer, ids[:2])
    assert [detok.add([t]) for t in output] + [detok.flush()] == ["", "", "\ufffd\ufffdb", ""]


def test_detokenizer_leading_space_uses_prompt_context(tokenizer):
    prompt = tokenizer.encode("Hello")
    out = tokenizer.encode("Hello world")[len(prompt) :]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.add(out) + detok.flush() == " world"


# ---------------------------------------------------------------------------------------------- stop strings


def reference_cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Text before the stop occurrence that completes first (ties at one end: the longest stop)."""
    hits = [(i + len(s), i) for s in stops if s for i in range(len(text)) if text.startswith(s, i)]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def run_matcher(stops: tuple[str, ...], chunks: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        piece, stopped = matcher.feed(chunk)
        out.append(piece)
        if stopped:
            with pytest.raises(RuntimeError):
                matcher.feed("more")
            assert matcher.flush() == ""
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def splits(text: str):
    """Every way to cut text into consecutive non-empty pieces (plus empty feeds at both ends)."""
    n = len(text)
    for mask in range(1 << max(n - 1, 0)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        yield [""] + [text[a:b] for a, b in itertools.pairwise(cuts)] + [""]


STOP_CASES = [
    (("ab",), ["xaby", "aab", "abab", "aaxb", "a", "xyz", "ba", "xa"]),
    (("ab", "b"), ["xaby", "xbab", "aab", "ccb", "aaa"]),
    (("b", "aba"), ["abab", "aba", "xaab"]),
    (("bcd", "abcde"), ["xabcdef", "abcd"]),
    (("abc", "bcd"), ["xabcd", "xbcde", "abbcd", "ab", "abx", "bc"]),
    (("ab", "abc"), ["xabc", "xab", "xabd", "aab"]),
    (("abc", "ab"), ["xabc", "xab"]),
    (("aaa",), ["aaaa", "aa", "baaab", "aabaaa"]),
    (("x", "yx"), ["ayxb", "ayyb", "y"]),
    (("\n\n", "END"), ["hi\n\nthere", "hi\nEN", "a\nEND\n\nb", "ENEND"]),
    (("", "c"), ["abc", "ab"]),
    ((), ["anything"]),
    (("日本",), ["こ日本語", "日日本", "日"]),
]


@pytest.mark.parametrize(("stops", "texts"), STOP_CASES)
def test_stop_matcher_every_split(stops, texts):
    for text in texts:
        expected = reference_cut(text, stops)
        for chunks in splits(text):
            assert run_matcher(stops, chunks) == expected, (stops, chunks)


def test_stop_matcher_random():
    rng = random.Random(2)
    for _ in range(2000):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(0, 4)
            chunks.append(text[i : i + n])
            i += n
        assert run_matcher(stops, chunks) == reference_cut(text, stops), (stops, chunks)


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(("STOP",))
    assert m.feed("hello S") == ("hello ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("x") == ("STx", False)
    assert m.feed("ST") == ("", False)
    assert m.feed("OP and more") == ("", True)
    assert m.stopped
    m = StopMatcher(("STOP",))
    assert m.feed("ab ST") == ("ab ", False)
    assert m.flush() == "ST"


def test_stop_matcher_overlapping_stops_cut_at_first_completed():
    assert StopMatcher(("b", "aba")).feed("abab") == ("a", True)
    assert StopMatcher(("ab", "b")).feed("xab") == ("x", True)
    assert StopMatcher(("bcd", "abcde")).feed("xabcdef") == ("xa", True)


# ---------------------------------------------------------------------------------------------- tokenizing


def test_short_texts_are_tokenized_on_the_event_loop_and_long_ones_on_the_worker(tokenizer):
    """A short prompt is tokenized where the handler runs (a thread hop costs more than the work: the
    burst's refusals wait on every request ahead of them); one over `INLINE_CHARS` on the worker
    thread, so a huge prompt never stalls the streams the loop serves. Both give the tokenizer's ids."""
    import asyncio
    import threading

    from specserve.gateway.http.tokenize import INLINE_CHARS, Tokenizing

    seen: list[str] = []

    class Watched:  # the real tokenizer, recording the thread each call runs on
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, text):
            seen.append(threading.current_thread().name)
            return tokenizer(text)

        def apply_chat_template(self, *args, **kwargs):
            seen.append(threading.current_thread().name)
            return tokenizer.apply_chat_template(*args, **kwargs)

    tok = Tokenizing(Watched(), 2048)
    short, long = "Hello there, how are you?", "word " * (INLINE_CHARS // 5 + 1)
    messages = [{"role": "user", "content": short}]

    async def run():
        return (await tok.encode(short), await tok.encode(long), await tok.chat(messages),
                await tok.chat([{"role": "user", "content": long}]))

    try:
        ids = asyncio.run(run())
    finally:
        tok.close()
    loop = threading.main_thread().name
    assert seen[0] == loop and seen[2] == loop
    assert seen[1].startswith("tokenize") and seen[3].startswith("tokenize")
    assert ids[0] == tokenizer(short)["input_ids"] and ids[1] == tokenizer(long)["input_ids"]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
    assert ids[2] == [int(t) for t in chat_ids]
