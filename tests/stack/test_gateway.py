"""The gateway end to end: `specserve up` as real processes, driven over HTTP by the official openai client.

The API, bad-input, losslessness and crash tests run twice, through the module's `stack` fixture:
against `specserve up --policy adaserve` on the demo pair ("real"), whose reference output is
transformers' greedy text, and against `specserve up --simulate cpu-demo` ("simulated"), whose
reference is the simulation's true continuation of each prompt (any policy must emit it exactly,
greedy). The other tests use the stack they are about: `real_up` or `simulated_up`.

Each stack's first `up` finds no profile and measures one (profile on first start); `--budget 24`
then pins B so the tests do not depend on this machine's timing. Other policies, the default `joint`
among them, run as extra gateways on the real stack's draft and target services, started the way
`up` starts its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from specserve.shared.simulate.preset import load_preset
from specserve.shared.simulate.text import load_corpus
from tests.support.fixtures import fresh_profile, start_up
from tests.support.gateway import (
    MAX_TOKENS,
    POLICIES,
    PROMPTS,
    TARGET,
    aclient,
    client,
    complete_all,
    every_policy_is_lossless,
    transformers_greedy,
    up_profile,
    wait_all_free,
)
from tests.support.procs import Up, gateway, service_pid, wait_health

PRESET = "cpu-demo"  # the simulated stack's preset


@pytest.fixture(scope="module")
def real_up(request, tmp_path_factory):
    profile = fresh_profile(tmp_path_factory)
    server = start_up(request, "--policy", "adaserve", profile=profile)
    assert profile.is_file(), "the gateway did not profile on first start"
    assert json.loads(profile.read_text())["budget_tokens"] >= 8
    return server


@pytest.fixture(scope="module")
def simulated_up(request, tmp_path_factory):
    profile = fresh_profile(tmp_path_factory, "simulated-profile")
    server = start_up(request, "--simulate", PRESET, "--policy", "adaserve", profile=profile)
    assert profile.is_file(), "the gateway did not profile the simulated target on first start"
    return server


@pytest.fixture(scope="module")
def real_reference() -> list[str]:
    return transformers_greedy()


@pytest.fixture(scope="module")
def simulated_reference() -> list[str]:
    return simulated_greedy(PROMPTS, MAX_TOKENS)


def simulated_greedy(prompts: list[str], max_tokens: int) -> list[str]:
    """The simulated target's output: the true continuation of each prompt (no EOS in the corpus)."""
    tok = AutoTokenizer.from_pretrained(TARGET)
    preset = load_preset(PRESET)
    truth = load_corpus(preset.corpus, preset.tokenizer, preset.seed)
    return [tok.decode(truth.continuation(tok(p)["input_ids"], max_tokens), skip_special_tokens=True)
            for p in prompts]


@pytest.fixture(scope="module", params=["real", "simulated"])
def stack(request) -> str:
    """Which stack the shared tests run against; `up` and `reference` follow it."""
    return request.param


@pytest.fixture(scope="module")
def up(request, stack) -> Up:
    return request.getfixturevalue(f"{stack}_up")


@pytest.fixture(scope="module")
def reference(request, stack) -> list[str]:
    return request.getfixturevalue(f"{stack}_reference")


# ---- the fast tier's end-to-end request -------------------------------------------------------------
@pytest.mark.fast
def test_one_request_through_the_three_services(real_up, real_reference):
    """One streamed chat request and one completion through gateway, draft and target (the official
    client): the completion equals transformers' greedy text, its tokens were drafted and verified
    (trees of more than the root), and both services hold nothing afterwards."""
    stream = client(real_up.url).chat.completions.create(
        model="target", messages=[{"role": "user", "content": "def f(x):"}], max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    r = client(real_up.url).completions.create(model="target", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == real_reference[0]
    assert any(nodes > 1 for _, nodes, _ in r.model_extra["specserve"]["steps"]), r.model_extra["specserve"]
    wait_all_free(real_up)


# ---- API shape -------------------------------------------------------------------------------------
def test_completions_non_streaming(up):
    r = client(up.url).completions.create(model="target", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].text


def test_chat_streaming_event_order(up):
    """Role chunk, content deltas, finish chunk, usage chunk, then [DONE], as raw SSE."""
    body = {"model": "target", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{up.url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] <= 10
    final = chunks[-2]["choices"][0]
    assert final["finish_reason"] in ("stop", "length") and final["delta"] == {}
    middle = chunks[1:-2]
    assert middle and all(c["choices"][0]["finish_reason"] is None and c["choices"][0]["delta"]["content"]
                          for c in middle)


def test_chat_non_streaming_and_completion_streaming_agree(up):
    c = client(up.url)
    chat = c.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi there"}],
                                     max_tokens=16, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi there"}],
                                       max_tokens=16, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == chat.choices[0].message.content
    text = c.completions.create(model="target", prompt=PROMPTS[1], max_tokens=16, temperature=0).choices[0].text
    streamed = c.completions.create(model="target", prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    pieces, usage = [], None
    for ch in streamed:
        if ch.choices:
            pieces.append(ch.choices[0].text)
        else:
            usage = ch.usage
    assert "".join(pieces) == text and usage is not None and usage.completion_tokens >= 1


def test_models_health_metrics(up):
    models = client(up.url).models.list()
    assert [m.id for m in models.data] == ["target"]
    assert httpx.get(f"{up.url}/health").status_code == 200
    resp = httpx.get(f"{up.url}/metrics")
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    metrics = resp.text
    for name in ("vllm:num_requests_running", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                 "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"):
        assert name in metrics
    slo = httpx.get(f"{up.url}/v1/slo_classes").json()
    assert slo["budget_tokens"] == 24 and set(slo["classes"]) >= {"critical", "search", "chat"}


def test_stop_strings_and_seeded_sampling(up):
    c = client(up.url)
    full = c.completions.create(model="target", prompt=PROMPTS[2], max_tokens=30, temperature=0).choices[0].text
    stop = full[5:8]
    cut = c.completions.create(model="target", prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    streamed = c.completions.create(model="target", prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop],
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == cut.choices[0].text
    a, b = (c.completions.create(model="target", prompt=PROMPTS[3], max_tokens=20, temperature=0.9, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


# ---- losslessness -------------------------------------------------------------------------------
def test_greedy_identical_across_policies(up, reference):
    """Every policy, with the prompts sent concurrently (so they batch), equals the target alone."""
    assert asyncio.run(complete_all(up.url, PROMPTS)) == reference  # adaserve, the up's own policy
    every_policy_is_lossless(up, reference)


def test_greedy_identical_across_policies_with_overlap(real_up, real_reference):
    """The same with drafting ahead (--overlap): every policy that drafts, and adaserve."""
    for policy in ["adaserve", *POLICIES[1:]]:
        g = gateway(real_up, policy, "--budget", "24", "--overlap")
        try:
            assert asyncio.run(complete_all(g.address, PROMPTS)) == real_reference, policy
        finally:
            g.stop()
    wait_all_free(real_up)


def test_greedy_identical_with_async_scheduling(up, reference):
    """One step ahead (--async-scheduling): `none` (every pass sent ahead), `chain:3` (chains drafted on a guess
    of the answer in flight) and the default `joint` (ahead where it plans no tree or chains) equal the target
    alone, the prompts batched, one of them ending at once (EOS first); then requests that end one by one at
    max_tokens, with a stop string, and streamed, beside each other."""
    for policy in ["none", "chain:3", "joint"]:
        g = gateway(up, policy, "--budget", "24", "--async-scheduling", "on")
        try:
            assert asyncio.run(complete_all(g.address, PROMPTS)) == reference, policy

            async def mixed(url=g.address):
                c = aclient(url)
                short = [c.completions.create(model="target", prompt=PROMPTS[i], max_tokens=n, temperature=0)
                         for i, n in enumerate([1, 2, 5, 9])]
                stop = c.completions.create(model="target", prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0,
                                            stop=[reference[4][8:14]])
                stream = await c.completions.create(model="target", prompt=PROMPTS[5], max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True)

                async def read():
                    return "".join([ch.choices[0].text async for ch in stream if ch.choices])

                out = await asyncio.gather(*short, stop, read())
                await c.close()
                return out

            *short, stop, streamed = asyncio.run(mixed())
            for r, i in zip(short, range(4)):
                assert reference[i].startswith(r.choices[0].text) and r.usage.completion_tokens == [1, 2, 5, 9][i]
            assert stop.choices[0].text == reference[4][:8] and stop.choices[0].finish_reason == "stop"
            assert streamed == reference[5], policy
            if policy != "joint":  # it plans no tree, or chains: its passes went ahead
                assert _counter(g.address, "specserve:passes_sent_ahead_total") > 10
            if policy == "chain:3":  # on guesses of the answer in flight, some of them right
                assert _counter(g.address, "specserve:chains_sent_ahead_hits_total") > 0
        finally:
            g.stop()
    wait_all_free(up)


# ---- load and isolation --------------------------------------------------------------------------
def test_32_concurrent_streams(up):
    async def one(c, i):
        pieces, usage, finish = [], None, None
        stream = await c.chat.completions.create(
            model="target", messages=[{"role": "user", "content": PROMPTS[i % 6][:80]}],
            max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
            service_tier=["critical", "search", "chat"][i % 3],
            extra_body={"slo": {"best_effort": True}})  # served whether or not its tier's SLO can be met
        async for ch in stream:
            if ch.choices:
                pieces.append(ch.choices[0].delta.content or "")
                finish = ch.choices[0].finish_reason or finish
            else:
                usage = ch.usage
        return "".join(pieces), finish, usage

    async def run():
        c = aclient(up.url)
        out = await asyncio.gather(*[one(c, i) for i in range(32)])
        await c.close()
        return out

    results = asyncio.run(run())
    assert len(results) == 32
    for text, finish, usage in results:  # a chat prompt may end at once (EOS first): 0 tokens is valid
        assert finish in ("stop", "length") and usage is not None and 0 <= usage.completion_tokens <= 12
        assert (finish == "length") == (usage.completion_tokens == 12) and bool(text) == (usage.completion_tokens > 0)
    assert sum(u.completion_tokens for _, _, u in results) > 32
    # identical prompts, greedy: identical outputs whatever the batch
    by_prompt = {}
    for i, (text, _, _) in enumerate(results):
        by_prompt.setdefault(i % 6, set()).add(text)
    assert all(len(texts) == 1 for texts in by_prompt.values())
    wait_all_free(up)


def _counter(url: str, name: str, **labels: str) -> float:
    """A metric's value at a /metrics URL (`url` without the path: a gateway's), summed over the samples
    with these labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url if url.endswith("/metrics") else f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _release_calls(up: Up) -> float:
    """Release calls the target has served since it started (its call histogram's count)."""
    return _counter(up.metrics["target"], "specserve:service_call_seconds_count", call="Release")


def test_releases_go_with_the_next_target_pass(up):
    """Requests that end one by one while others run are released by the replica's next Forward
    (`Forward.release`): the target serves at most one Release call for the burst (the last request's,
    when no pass runs) and holds nothing after it."""
    lengths = [3, 6, 9, 12, 15, 18]  # each ends at its own iteration

    async def run():
        c = aclient(up.url)
        out = await asyncio.gather(*[c.completions.create(model="target", prompt=PROMPTS[i], max_tokens=n,
                                                          temperature=0, extra_body={"ignore_eos": True})
                                     for i, n in enumerate(lengths)])
        await c.close()
        return out

    before = _release_calls(up)
    assert [r.usage.completion_tokens for r in asyncio.run(run())] == lengths
    wait_all_free(up)
    assert _release_calls(up) - before <= 1


def test_tight_slo_gets_larger_trees(up):
    """Same prompt, same batch: the request with the tight TPOT SLO is given more tree nodes. (No replica
    can promise 1 ms, so it allows best effort: SLO admission, the default, would refuse it otherwise.)"""
    async def run():
        c = aclient(up.url)
        kw = dict(model="target", prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0)
        out = await asyncio.gather(c.completions.create(**kw, extra_body={"slo": {"tpot_ms": 1, "best_effort": True}}),
                                   c.completions.create(**kw, extra_body={"slo": {"tpot_ms": 100000}}))
        await c.close()
        return out

    tight, loose = (r.model_extra["specserve"] for r in asyncio.run(run()))
    assert tight["slo"]["tpot_ms"] == 1 and loose["slo"]["tpot_ms"] == 100000
    t_steps = {s: n for s, n, _ in tight["steps"]}
    shared = [(t_steps[s], n) for s, n, _ in loose["steps"] if s in t_steps]
    assert len(shared) >= 3, (tight, loose)
    assert sum(t for t, _ in shared) > sum(n for _, n in shared), shared
    assert all(t >= n for t, n in shared), shared


def test_disconnect_frees_kv_everywhere(up):
    body = {"model": "target", "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{up.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    # the connection is closed here, mid-generation
    wait_all_free(up)
    metrics = httpx.get(f"{up.url}/metrics").text
    assert 'finished_reason="abort"' in metrics


BAD = [
    (b"{not json", None),
    (b"[]", None),
    (json.dumps({"model": "nope", "prompt": "x"}).encode(), "model"),
    (json.dumps({"model": "target", "prompt": "x", "n": 17}).encode(), "n"),
    (json.dumps({"model": "target", "prompt": "x", "max_tokens": -3}).encode(), "max_tokens"),
    (json.dumps({"model": "target", "prompt": "x", "temperature": 9}).encode(), "temperature"),
    (json.dumps({"model": "target", "prompt": "x", "service_tier": "platinum"}).encode(), "service_tier"),
    (json.dumps({"model": "target", "prompt": [5, 99999]}).encode(), "prompt"),
    (json.dumps({"model": "target", "prompt": "x " * 5000}).encode(), "prompt"),
    (json.dumps({"model": "target", "prompt": "x", "max_tokens": 4096}).encode(), "max_tokens"),
    (json.dumps({"model": "target", "prompt": "x", "slo": {"tpot_ms": -1}}).encode(), "slo.tpot_ms"),
]


def test_bad_requests_get_400_while_others_continue(up, reference):
    """Every kind of bad request is answered 400 while a stream is in flight (it has sent text and not
    finished when they are sent); the stream still ends with the reference text."""
    async def run():
        c = aclient(up.url)
        good = await Stream.start(c, PROMPTS[0])
        assert good.started and not good.finished, "the stream was not in flight when the bad requests went"
        async with httpx.AsyncClient(base_url=up.url, timeout=60) as h:
            bad = [await h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                   for body, _ in BAD]
        text = await good.rest()
        await c.close()
        return bad, text

    bad, text = asyncio.run(run())
    for resp, (body, param) in zip(bad, BAD):
        assert resp.status_code == 400, (body[:60], resp.text)
        err = resp.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
        assert err["param"] == param, (body[:60], err)
    assert text == reference[0]
    with pytest.raises(openai.BadRequestError):
        client(up.url).completions.create(model="target", prompt="x", n=17)
    wait_all_free(up)


class Stream:
    """A greedy streamed completion of one prompt (MAX_TOKENS), read up to its first text by `start`
    and to its end by `rest`."""

    def __init__(self, chunks) -> None:
        self.chunks = chunks.__aiter__()
        self.pieces: list[str] = []
        self.finished = False

    @classmethod
    async def start(cls, c: openai.AsyncOpenAI, prompt: str, timeout_s: float = 60) -> Stream:
        """Waits (at most `timeout_s`) for the stream's first text, or its end if it ends first."""
        stream = cls(await c.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True))
        await asyncio.wait_for(stream._read(until_text=True), timeout_s)
        return stream

    @property
    def started(self) -> bool:
        return any(self.pieces)

    async def _read(self, until_text: bool) -> None:
        async for ch in self.chunks:
            if not ch.choices:
                continue
            self.pieces.append(ch.choices[0].text)
            self.finished = ch.choices[0].finish_reason is not None
            if self.finished or (until_text and self.started):
                return

    async def rest(self) -> str:
        if not self.finished:
            await self._read(until_text=False)
        return "".join(self.pieces)


def requests_running(url: str) -> float:
    """The gateway's vllm:num_requests_running, summed over its label sets."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:num_requests_running"))


# ---- crashes and Ctrl-C ----------------------------------------------------------------------------
def test_draft_crash_is_survived_losslessly(up, reference):
    """Kill the draft mid-run (three streams have sent text and none has finished, and the gateway counts
    them running, when the kill goes): the requests still finish with the reference output, `up`
    restarts the draft on its address, and the gateway speculates again."""
    async def run():
        c = aclient(up.url)
        streams = await asyncio.gather(*[Stream.start(c, p) for p in PROMPTS[:3]])
        in_flight = [s.started and not s.finished for s in streams]
        running = requests_running(up.url)
        os.kill(service_pid("draft", up.draft), signal.SIGKILL)
        assert all(in_flight) and running == 3, f"not mid-run at the kill: in flight {in_flight}, running {running}"
        out = [await s.rest() for s in streams]
        await c.close()
        return out

    assert asyncio.run(run()) == reference[:3]
    wait_health(up.url, lambda h: h["draft"] is True, "the draft to come back", timeout_s=90)
    r = client(up.url).completions.create(model="target", prompt=PROMPTS[5], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference[5]
    assert any(nodes > 1 for _, nodes, _ in r.model_extra["specserve"]["steps"]), "no speculation after restart"
    wait_all_free(up)


def test_an_int8_target_is_lossless_under_every_policy(real_up):
    """A target on weights quantized to Q8_0 at load runs int8 activations (the default for quantized
    weights): every policy gives exactly what policy `none` gives on that target."""
    server = Up("--weights", "q8_0", "--activations", "int8", "--policy", "none", "--profile", up_profile(real_up))
    try:
        reference = asyncio.run(complete_all(server.url, PROMPTS))
        every_policy_is_lossless(server, reference)
    finally:
        server.interrupt()


def test_up_stops_cleanly_on_ctrl_c(real_up):
    server = Up("--policy", "none", "--profile", up_profile(real_up))
    pids = [service_pid(k, server.addresses[k]) for k in ("draft", "target")]
    assert client(server.url).completions.create(model="target", prompt="x", max_tokens=3).choices
    assert server.interrupt() == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")



# ---- the simulated stack alone ----------------------------------------------------------------------
def test_n_simulated_replicas_start_and_serve(simulated_up, simulated_reference):
    """Three simulated target replicas behind one gateway: every one serves, output is the truth."""
    server = Up("--simulate", PRESET, "--targets", "3", "--profile", up_profile(simulated_up), "--", "--budget", "24")
    try:
        assert [r["up"] for r in httpx.get(f"{server.url}/health").json()["replicas"]] == [True] * 3

        async def run():
            c = aclient(server.url)
            out = await asyncio.gather(*[c.completions.create(model="target", prompt=p, max_tokens=MAX_TOKENS,
                                                              temperature=0) for p in PROMPTS * 2])
            await c.close()
            return out

        results = asyncio.run(run())
        assert [r.choices[0].text for r in results] == simulated_reference * 2
        assert {r.model_extra["specserve"]["replica"] for r in results} == {0, 1, 2}
    finally:
        assert server.interrupt() == 0
