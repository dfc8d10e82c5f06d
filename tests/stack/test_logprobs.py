"""Logprobs through the whole stack, with the official openai client on the demo pair.

The module's `up` (the default policy) and two more gateways on its services, `--policy none` and
`--policy chain:4` (that one with `--frontends 1`: its HTTP side in a process of its own, so the
logprobs also cross the front ends' link), answer the same requests: their logprobs are the same
under every policy, and are transformers' log_softmax of the same positions within 1e-4 (greedy,
and sampled at a temperature, which does not change them); the top logprobs are sorted and hold the
chosen token where it ranks. `echo` returns the prompt's logprobs (a prompt longer than one prefill
chunk included), streamed chunks' logprobs concatenate to the whole ones, a stop string ends them
with the text, and a request preempted while it decodes sends each token's logprob once.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.support.gateway import PROMPTS, TARGET, aclient, client, wait_all_free
from tests.support.procs import gateway

TOP = 5
NEW = 24
LONG = (" ".join(PROMPTS) * 3)[:1500]  # 428 tokens: more than one 256-token prefill chunk


@pytest.fixture(scope="module")
def urls(up):
    """The default policy's gateway, then `none`'s, then `chain:4`'s (HTTP in a front-end process)."""
    none = gateway(up, "none", "--budget", "24")
    chain = gateway(up, "chain:4", "--budget", "24", "--frontends", "1")
    yield [up.url, none.address, chain.address]
    chain.stop()
    none.stop()
    wait_all_free(up)


@pytest.fixture(scope="module")
def hf():
    tok = AutoTokenizer.from_pretrained(TARGET)
    return tok, AutoModelForCausalLM.from_pretrained(TARGET, dtype="float32").eval()


def reference_rows(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of `ids` [len, V]: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf[1](torch.tensor([ids])).logits[0].float(), -1)


def ids_of(hf, contents) -> list[int]:
    """Chat logprob entries back to token ids, through their bytes (the demo tokenizer is byte-level BPE)."""
    alphabet = bytes_to_unicode()
    return [hf[0].convert_tokens_to_ids("".join(alphabet[b] for b in c.bytes)) for c in contents]


async def ask(url: str):
    """Greedy completions of three prompts with logprobs 5, and a sampled chat with top_logprobs 5."""
    c = aclient(url)
    try:
        completions = [c.completions.create(model="target", prompt=p, max_tokens=NEW, temperature=0, logprobs=TOP)
                       for p in PROMPTS[:3]]
        chat = c.chat.completions.create(model="target", messages=[{"role": "user", "content": PROMPTS[3]}],
                                         max_tokens=NEW, temperature=0.9, top_p=0.9, seed=7, logprobs=True,
                                         top_logprobs=TOP)
        return await asyncio.gather(*completions, chat)
    finally:
        await c.close()


def test_logprobs_are_the_targets_log_softmax_under_every_policy(urls, hf):
    tok = hf[0]
    answers = [asyncio.run(ask(url)) for url in urls]
    first = answers[0]
    for other in answers[1:]:  # the same tokens and the same values, to the bit, under every policy
        assert [a.choices[0].logprobs for a in other] == [a.choices[0].logprobs for a in first]
    for prompt, answer in zip(PROMPTS[:3], first[:3]):
        lp = answer.choices[0].logprobs
        prompt_ids = tok(prompt)["input_ids"]
        out: list[int] = []
        for _ in lp.tokens:  # the greedy continuation, as transformers makes it
            out.append(int(reference_rows(hf, prompt_ids + out)[-1].argmax()))
        ref = reference_rows(hf, prompt_ids + out)[len(prompt_ids) - 1:]
        assert lp.tokens == [tok.decode([t]) for t in out] and answer.choices[0].text == "".join(lp.tokens)
        assert torch.allclose(torch.tensor(lp.token_logprobs), ref.gather(1, torch.tensor(out)[:, None])[:, 0],
                              atol=1e-4)
        for top, row, chosen in zip(lp.top_logprobs, ref, out):
            values = list(top.values())
            assert values == sorted(values, reverse=True) and tok.decode([chosen]) == next(iter(top))
            assert torch.allclose(torch.tensor(values[:TOP]), row.topk(TOP).values, atol=1e-4)
    chat = first[3].choices[0].logprobs.content
    out = ids_of(hf, chat)
    assert tok.decode(out) == first[3].choices[0].message.content
    chat_ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[3]}], add_generation_prompt=True)
    chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
    ref = reference_rows(hf, list(chat_ids) + out)[len(chat_ids) - 1:]
    assert torch.allclose(torch.tensor([c.logprob for c in chat]), ref.gather(1, torch.tensor(out)[:, None])[:, 0],
                          atol=1e-4)  # raw logprobs: the temperature and top_p do not change them
    for entry, row in zip(chat, ref):
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and len(values) == TOP
        assert torch.allclose(torch.tensor(values), row.topk(TOP).values, atol=1e-4)
        assert (entry.token in [t.token for t in entry.top_logprobs]) == (entry.logprob >= values[-1])


def test_echo_returns_the_prompts_logprobs(urls, hf):
    c = client(urls[0])
    for prompt in (PROMPTS[0], LONG):
        plain = c.completions.create(model="target", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
        echo = c.completions.create(model="target", prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
        text, lp = echo.choices[0].text, echo.choices[0].logprobs
        ids = hf[0](prompt)["input_ids"]
        assert plain.usage.completion_tokens == 4 and len(ids) > (256 if prompt is LONG else 0)
        assert text == prompt + plain.choices[0].text and len(lp.tokens) == len(ids) + 4
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        ref = reference_rows(hf, ids)
        assert torch.allclose(torch.tensor(lp.token_logprobs[1:len(ids)]),
                              ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-4)
        assert lp.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs
        assert [o - len(prompt) for o in lp.text_offset[len(ids):]] == plain.choices[0].logprobs.text_offset
    bare = c.completions.create(model="target", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True)
    assert bare.choices[0].text.startswith(PROMPTS[1]) and bare.choices[0].logprobs is None


def test_streamed_logprobs_concatenate_to_the_whole_ones_and_stop_with_the_text(urls):
    kw = dict(model="target", prompt=PROMPTS[2], max_tokens=NEW, temperature=0, logprobs=3, echo=True)
    wholes = [client(url).completions.create(**kw).choices[0] for url in (urls[0], urls[2])]
    assert wholes[0].logprobs == wholes[1].logprobs  # the same beside the engine and in a front-end process
    assert min(wholes[0].logprobs.token_logprobs[1:]) > -50  # (a token without its row would be at the floor)
    for url, whole in zip((urls[0], urls[2]), wholes):
        c = client(url)
        chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
        assert "".join(ch.text for ch in chunks) == whole.text
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for ch in chunks if ch.logprobs for x in getattr(ch.logprobs, field)] == \
                getattr(whole.logprobs, field)
        chat_kw = dict(model="target", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=NEW,
                       temperature=0, logprobs=True, top_logprobs=2)
        whole_chat = c.chat.completions.create(**chat_kw).choices[0]
        streamed = [ch.choices[0] for ch in c.chat.completions.create(**chat_kw, stream=True) if ch.choices]
        assert [e for ch in streamed if ch.logprobs for e in ch.logprobs.content] == whole_chat.logprobs.content
        # a stop string in the middle of the output: the text ends before it, and so do the logprobs
        plain = "".join(whole.logprobs.tokens[len(whole.logprobs.tokens) - NEW:])
        stop = plain[len(plain) // 2: len(plain) // 2 + 3]
        cut = c.completions.create(model="target", prompt=PROMPTS[2], max_tokens=NEW, temperature=0, logprobs=1,
                                   stop=[stop]).choices[0]
        joined, last = "".join(cut.logprobs.tokens), cut.logprobs.tokens[-1]
        assert cut.finish_reason == "stop" and cut.text == plain[:plain.index(stop)] and cut.text
        assert joined.startswith(cut.text) and len(joined) - len(last) < len(cut.text) <= len(joined)


def test_a_preempted_request_sends_each_logprob_once(up, urls):
    """One slot: a best-effort stream with echo and logprobs is preempted by an SLO request and rebuilds
    its KV; its prompt's and tokens' logprobs arrive once each, as an undisturbed request's."""
    g = gateway(up, "none", "--budget", "24", "--admission", "slo", "--router", "slo", "--max-running", "1")
    kw = dict(model="target", prompt=PROMPTS[3], max_tokens=NEW, temperature=0, logprobs=2, echo=True)
    try:
        async def run():
            c = aclient(g.address)
            stream = await c.completions.create(**kw, stream=True, extra_body={
                "slo": {"tpot_ms": 0.01, "best_effort": True}})
            got, arrived = [], asyncio.Event()

            async def consume():
                async for ch in stream:
                    if ch.choices and ch.choices[0].logprobs:
                        got.append(ch.choices[0].logprobs)
                        if len(got) == 3:
                            arrived.set()

            async def slo_request():
                await arrived.wait()
                return await c.completions.create(model="target", prompt=PROMPTS[4], max_tokens=NEW, temperature=0,
                                                  extra_body={"service_tier": "chat"})  # may not run best effort

            await asyncio.gather(consume(), slo_request())
            await c.close()
            return got

        got = asyncio.run(run())
        whole = client(urls[1]).completions.create(**kw).choices[0].logprobs
        assert [t for lp in got for t in lp.tokens] == whole.tokens
        assert [v for lp in got for v in lp.token_logprobs] == whole.token_logprobs
        metrics = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{g.address}/metrics").text)
                   for s in f.samples}
        assert metrics["vllm:num_preemptions_total"] >= 1
    finally:
        g.stop()
    wait_all_free(up)
