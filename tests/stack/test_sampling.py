"""The sampling fields a vLLM user sends, end to end: `specserve up` (the demo pair, the default policy
`joint`) and gateways with `--policy none` and `chain:4` on its services, driven by the official openai
client.

Greedy output with every penalty is the same under the three policies (and differs from plain greedy:
the penalties act); n = 4 gives four choices, streamed and whole, each reproducible with a seed, under
every policy; stop_token_ids end the output at the id (kept, as vLLM keeps it); min_tokens holds EOS
back; a request whose n choices the queue cannot all take is refused whole; a client that leaves an n = 4
stream ends all four; the model's generation_config.json fills what a request leaves out. Every test
ends with both services holding nothing.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.gateway import PROMPTS, TARGET, aclient, client, wait_all_free
from tests.support.procs import gateway

# min_tokens keeps EOS back: the penalties alone make the demo target end most prompts at once
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.3,
             "extra_body": {"repetition_penalty": 1.2, "min_tokens": 30}}
MAX_NEW = 48


@pytest.fixture(scope="module")
def urls(request, up) -> dict[str, str]:
    """The default policy (up's own gateway), then `none` and `chain:4` on the same services."""
    out = {"joint": up.url}
    for policy in ("none", "chain:4"):
        g = gateway(up, policy, "--budget", "24")
        request.addfinalizer(g.stop)
        out[policy] = g.address
    return out


async def completions(url: str, prompts: list[str], **kw) -> list:
    c = aclient(url)
    try:
        return await asyncio.gather(*[c.completions.create(model="target", prompt=p, max_tokens=MAX_NEW, **kw)
                                      for p in prompts])
    finally:
        await c.close()


def test_greedy_with_penalties_is_the_same_under_every_policy(up, urls):
    prompts = PROMPTS[:6]
    results = {policy: asyncio.run(completions(url, prompts, temperature=0, **PENALTIES))
               for policy, url in urls.items()}
    runs = {policy: [r.choices[0].text for r in rs] for policy, rs in results.items()}
    assert runs["none"] == runs["chain:4"] == runs["joint"], runs
    accepted = [acc for r in results["chain:4"] for _, _, acc in r.model_extra["specserve"]["steps"]]
    assert sum(accepted) > len(prompts) * 10, accepted  # drafts were verified and accepted at depth > 1
    plain = [r.choices[0].text for r in asyncio.run(completions(up.url, prompts, temperature=0))]
    assert plain != runs["none"]  # the penalties change the text
    with_min_p = [r.choices[0].text for r in asyncio.run(completions(urls["none"], prompts, temperature=0,
                                                                       extra_body={"min_p": 0.5}))]
    assert with_min_p == plain  # min_p never drops the most likely token
    wait_all_free(up)


def test_n_choices_reproducible_with_a_seed_under_every_policy(up, urls):
    kw = dict(model="target", prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=1.0, seed=1234, n=4, **PENALTIES)
    whole = {policy: client(url).completions.create(**kw) for policy, url in urls.items()}
    texts = {policy: [c.text for c in sorted(r.choices, key=lambda c: c.index)] for policy, r in whole.items()}
    assert texts["none"] == texts["chain:4"] == texts["joint"], texts
    assert len(set(texts["none"])) > 1  # choice i samples with seed + i
    r = whole["joint"]
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and all(c.finish_reason for c in r.choices)
    alone = [client(up.url).completions.create(**{**kw, "n": 1, "seed": 1234 + i}) for i in range(4)]
    assert [a.choices[0].text for a in alone] == texts["joint"]  # choice i is the request with seed + i
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    again = client(up.url).completions.create(**kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts["joint"]  # a second run
    streamed = client(urls["chain:4"]).completions.create(**kw, stream=True, stream_options={"include_usage": True})
    pieces, finishes, usage = [""] * 4, [None] * 4, None
    for chunk in streamed:
        if not chunk.choices:
            usage = chunk.usage
        for c in chunk.choices:
            assert finishes[c.index] is None, "text after the choice's finish chunk"
            pieces[c.index] += c.text
            finishes[c.index] = c.finish_reason
    assert pieces == texts["none"] and all(finishes) and usage.completion_tokens == r.usage.completion_tokens
    chat = client(urls["none"]).chat.completions.create(
        model="target", messages=[{"role": "user", "content": "def f(x):"}], max_tokens=8, n=3, temperature=0.8,
        seed=5, extra_body={"best_of": 3})
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    lp = dict(model="target", prompt=PROMPTS[2], max_tokens=6, temperature=1.0, logprobs=2)
    pair = client(urls["none"]).completions.create(**lp, n=2, seed=7)
    second = next(c for c in pair.choices if c.index == 1).logprobs
    alone = client(urls["none"]).completions.create(**lp, seed=8).choices[0].logprobs  # each choice its own
    assert second.tokens == alone.tokens and second.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client(up.url).completions.create(**{**kw, "best_of": 5})
    wait_all_free(up)


def test_stop_token_ids_end_the_output_and_min_tokens_holds_eos(up, urls):
    tok = AutoTokenizer.from_pretrained(TARGET)
    c = client(urls["chain:4"])
    full = c.completions.create(model="target", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0)
    ids = tok(full.choices[0].text, add_special_tokens=False)["input_ids"]
    stop = ids[6]
    cut = c.completions.create(model="target", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0,
                               extra_body={"stop_token_ids": [stop]})
    assert cut.choices[0].finish_reason == "stop"
    assert full.choices[0].text.startswith(cut.choices[0].text) and tok.decode([stop]) in cut.choices[0].text
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    ends = c.completions.create(model="target", prompt=PROMPTS[6], max_tokens=MAX_NEW, temperature=0)
    assert ends.usage.completion_tokens == 0 and ends.choices[0].finish_reason == "stop"  # EOS first
    for url in (urls["chain:4"], urls["joint"]):
        held = client(url).completions.create(model="target", prompt=PROMPTS[6], max_tokens=MAX_NEW, temperature=0,
                                              extra_body={"min_tokens": 5})
        assert held.usage.completion_tokens >= 5, held
    wait_all_free(up)


def test_n_choices_are_refused_whole_and_end_together(up):
    """A queue with room for two takes none of four choices (503); a client that leaves a stream of four
    choices ends them all (no request or KV left in either service)."""
    g = gateway(up, "none", "--budget", "24", "--max-waiting", "2")
    try:
        with pytest.raises(openai.APIStatusError) as info:
            client(g.address).completions.create(model="target", prompt=PROMPTS[0], max_tokens=4, n=4)
        assert info.value.status_code == 503
        wait_all_free(up)
        body = {"model": "target", "prompt": PROMPTS[0], "max_tokens": 1000, "n": 4, "stream": True,
                "temperature": 0.5}
        with httpx.stream("POST", f"{up.url}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            seen = {line for line in (next(lines) for _ in range(20)) if line.startswith("data: ")}
            assert seen
        wait_all_free(up)
    finally:
        g.stop()


def test_a_request_leaving_fields_out_gets_the_models_defaults(up, urls, tmp_path):
    """--generation-config DIR: its generation_config.json's temperature and repetition_penalty fill what a
    request leaves out; a directory without one stops the gateway at start, naming it."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "repetition_penalty": 1.2}')
    g = gateway(up, "chain:4", "--budget", "24", "--generation-config", str(tmp_path))
    try:
        defaults = asyncio.run(completions(g.address, PROMPTS[:3], extra_body={"min_tokens": 30}))
    finally:
        g.stop()
    explicit = asyncio.run(completions(urls["none"], PROMPTS[:3], temperature=0,
                                       extra_body={"min_tokens": 30, "repetition_penalty": 1.2}))
    assert [r.choices[0].text for r in defaults] == [r.choices[0].text for r in explicit]
    with pytest.raises(RuntimeError, match="no generation_config.json there"):
        gateway(up, "none", "--generation-config", str(tmp_path / "missing"))
    wait_all_free(up)
