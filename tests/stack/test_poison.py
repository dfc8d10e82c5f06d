"""Poison under load: extreme and malformed requests sent while 8 greedy streams run hurt nobody.

One `specserve up`. Eight greedy streams (the prompts of test_gateway.py, one twice) are started
and, once every one of them is generating, a wave of poison is sent at once: sampling values at
the edge of what validation accepts (a temperature of 1e-38 used to make the target's sampler
raise and fail the whole batched Forward, ending every co-batched stream), values it must refuse
(huge numbers, 10k stop strings, a 1 MB stop string, surrogates, invalid UTF-8, deep nesting,
unsupported features, a body over the size limit), and structured output (valid, served beside the
streams, and malformed). Every stream must end with exactly the target's greedy text (transformers'
reference), every poison must get its expected status (200 for the accepted extremes, which must
also have run while the streams did, 400 or 413 for the rest), and afterwards both services hold no
request and no KV block.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.support.gateway import MAX_TOKENS, PROMPTS, wait_all_free

STREAM_PROMPTS = [*PROMPTS, PROMPTS[0]]  # 8 streams; PROMPTS[6] ends at once (EOS first)


def completion(**fields) -> bytes:
    return json.dumps({"model": "target", "prompt": "x = ", "max_tokens": 8, **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"model": "target", "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 8,
                       **fields}).encode()


C, CHAT = "/v1/completions", "/v1/chat/completions"
# (name, endpoint, body, expected status, expected param of a 400)
POISON = [
    ("temperature 1e-38", C, completion(temperature=1e-38), 200, None),
    ("temperature 5e-324", C, completion(temperature=5e-324), 200, None),
    ("top_p 1e-300", C, completion(top_p=1e-300), 200, None),
    ("top_p 5e-324 top_k 1 temperature 2", C, completion(top_p=5e-324, top_k=1, temperature=2), 200, None),
    ("top_k 10**30 (an integer)", C, completion(top_k=10**30, temperature=1.0, seed=3), 200, None),
    ("streamed temperature 1e-38", C, completion(temperature=1e-38, stream=True), 200, None),
    ("chat temperature 1e-38 top_p 1e-300", CHAT, chat(temperature=1e-38, top_p=1e-300, seed=-1), 200, None),
    ("ignore_eos temperature 1e-30", C, completion(temperature=1e-30, ignore_eos=True, max_tokens=12), 200, None),
    ("seed -1", C, completion(temperature=0.8, seed=-1), 200, None),
    ("seed -2**63", C, completion(temperature=0.8, seed=-(2**63)), 200, None),
    ("seed 2**64-1", C, completion(temperature=2, seed=2**64 - 1), 200, None),
    # no replica can promise it: SLO admission (the default) refuses it at once, beside the streams
    ("slo tpot 1e-300", C, completion(temperature=0, slo={"tpot_ms": 1e-300, "ttft_ms": 1e-300}), 503, None),
    ("slo tpot 1e-300, best effort", C,
     completion(temperature=0, slo={"tpot_ms": 1e-300, "ttft_ms": 1e-300, "best_effort": True}), 200, None),
    ("prompt NUL and a surrogate pair", C, b'{"model": "target", "prompt": "\\u0000\\ud83d\\ude00", "max_tokens": 4}',
     200, None),
    ("top_k 1e30 (a float)", C, completion(top_k=1e30), 400, "top_k"),
    ("max_tokens 10**30", C, completion(max_tokens=10**30), 400, "max_tokens"),
    ("max_tokens 1e30", C, completion(max_tokens=1e30), 400, "max_tokens"),
    ("max_tokens past the context", C, completion(max_tokens=1_000_000), 400, "max_tokens"),
    ("seed 10**30", C, completion(seed=10**30), 400, "seed"),
    ("temperature 1e400", C, b'{"model": "target", "prompt": "x", "temperature": 1e400}', 400, "temperature"),
    ("temperature NaN", C, b'{"model": "target", "prompt": "x", "temperature": NaN}', 400, None),
    ("10k stop strings", C, completion(stop=[f"s{i}" for i in range(10_000)]), 400, "stop"),
    ("a 1 MB stop string", C, completion(stop="x" * 2**20), 400, "stop"),
    ("an unpaired surrogate", C, b'{"model": "target", "prompt": "a\\ud800b", "max_tokens": 4}', 400, None),
    ("a UTF-8 encoded surrogate", C, b'{"model": "target", "prompt": "a\xed\xa0\x80", "max_tokens": 4}', 400, None),
    ("invalid UTF-8", C, b'{"model": "target", "prompt": "x", "user": "\xff\xfe"}', 400, None),
    ("nested 5000 deep", C, b'{"model": "target", "prompt": "x", "junk": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     None),
    ("chat nested 100k deep", CHAT, chat(tools="@")[:-1].replace(b'"@"', b'{"a": ' * 100_000 + b"1" + b"}" * 100_000)
     + b"}", 400, None),
    ("penalties at their limits", C, completion(repetition_penalty=1e-300, presence_penalty=2, frequency_penalty=-2,
                                                min_p=1, temperature=1, seed=5), 200, None),
    ("n 4 best_of 4 min_tokens 8 stop ids", C, completion(n=4, best_of=4, min_tokens=8, stop_token_ids=[0, 1, 2],
                                                          temperature=2, seed=9, stream=True), 200, None),
    ("repetition_penalty 0", C, completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("n 17", CHAT, chat(n=17), 400, "n"),
    # structured output beside the streams: its masks travel with its own entries alone
    ("response_format json_object", CHAT, chat(response_format={"type": "json_object"}), 200, None),
    ("guided_regex sampled", C, completion(guided_regex="[a-z]{3,9}", temperature=1.5, seed=7), 200, None),
    ("guided_regex unbalanced", C, completion(guided_regex="a(b"), 400, "guided_regex"),
    ("guided_regex with a dead end", C, completion(guided_regex="x[^\\s\\S]"), 200, None),  # "x", then nothing
    ("response_format yaml", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("token id 2**63", C, b'{"model": "target", "prompt": [9223372036854775808]}', 400, "prompt"),
    ("a 9 MB body", C, completion(junk="x" * (9 * 2**20)), 413, None),
]


async def greedy_stream(h: httpx.AsyncClient, prompt: str, started: asyncio.Event) -> tuple[str, float]:
    body = {"model": "target", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    pieces = []
    async with h.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            pieces.extend(c["text"] for c in chunk["choices"])
    return "".join(pieces), time.monotonic()


async def poison(h: httpx.AsyncClient, path: str, body: bytes):
    resp = await h.post(path, content=body, headers={"content-type": "application/json"})
    return resp, time.monotonic()


def test_poison_hurts_no_stream(up, reference):
    async def run():
        async with httpx.AsyncClient(base_url=up.url, timeout=120) as h:
            started = [asyncio.Event() for _ in STREAM_PROMPTS]
            streams = [asyncio.ensure_future(greedy_stream(h, p, e)) for p, e in zip(STREAM_PROMPTS, started)]
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in started]), 120)
            answers = await asyncio.gather(*[poison(h, path, body) for _, path, body, _, _ in POISON])
            return await asyncio.gather(*streams), answers

    streams, answers = asyncio.run(run())
    expected = [reference[PROMPTS.index(p)] for p in STREAM_PROMPTS]
    assert [text for text, _ in streams] == expected
    last_stream_end = max(end for _, end in streams)
    for (name, _, _, status, param), (resp, answered) in zip(POISON, answers):
        assert resp.status_code == status, (name, resp.status_code, resp.text[:300])
        if status == 200:
            if resp.headers["content-type"].startswith("text/event-stream"):
                assert resp.text.rstrip().endswith("data: [DONE]") and '"error"' not in resp.text, name
            else:
                assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length"), name
            assert answered < last_stream_end, f"{name} did not run beside the streams; the test proves little"
        else:
            err = resp.json()["error"]
            kind = "service_unavailable" if status == 503 else "invalid_request_error"
            assert err["type"] == kind and err["message"], (name, err)
            assert err["param"] == param, (name, err)
            assert status != 503 or int(resp.headers["retry-after"]) >= 1, name
    wait_all_free(up)
