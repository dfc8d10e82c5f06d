"""SLO-aware admission (`--admission slo`) through real processes and the official openai client.

- a request whose SLO no replica can meet is refused at once: 503 with Retry-After, the openai
  client's usual error type, before any byte of a stream; requests beside it are served exactly; one
  whose TTFT is below even its own prompt's prefill is refused on arrival, before the next iteration;
- the same request allowing best effort (`slo.best_effort`, or `service_tier: "flex"`) is served in the
  best-effort tier and equals transformers' greedy output; so is a request that asks for no SLO at all;
- the outcomes are counted per tier in `specserve:admission_total`; no KV block is left reserved;
- with a KV look-ahead on a pool too small for every worst case, requests are preempted, resume by
  recompute and still equal transformers; `vllm:num_preemptions_total` counts them.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.shared.host.launch import ServiceProcess
from specserve.shared.wire.service_client import DraftClient, TargetClient
from tests.support import poll
from tests.support.gateway import MAX_TOKENS, PROMPTS, aclient, wait_all_free
from tests.support.procs import gateway

IMPOSSIBLE = {"tpot_ms": 0.01}  # 10 µs per token: no replica can promise it


def admission_counts(url: str) -> dict[tuple[str, str], float]:
    """specserve:admission_total by (outcome, tier), parsed with prometheus_client's own parser."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name == "specserve:admission":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["outcome"], s.labels["tier"])] = s.value
    return out


@pytest.fixture
def slo_gateway(up):
    """A second gateway on the module's services with SLO-aware admission (stopped after the test: a
    gateway that connects releases what it does not own)."""
    g = gateway(up, "none", "--budget", "24", "--admission", "slo", "--router", "slo")
    yield g
    g.stop()


def test_unmeetable_slo_is_refused_at_once_and_others_are_served(up, slo_gateway, reference):
    async def run():
        c = aclient(slo_gateway.address)
        ok = [c.completions.create(model="target", prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0)
              for i in range(2)]
        bad = c.completions.create(model="target", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                   stream=True, extra_body={"slo": IMPOSSIBLE})
        out = await asyncio.gather(*ok, bad, return_exceptions=True)
        await c.close()
        return out

    a, b, refused = asyncio.run(run())
    assert isinstance(refused, openai.InternalServerError) and refused.status_code == 503, refused
    assert int(refused.response.headers["retry-after"]) >= 1
    body = refused.response.json()["error"]
    assert body["type"] == "service_unavailable" and "SLO" in body["message"]
    assert [a.choices[0].text, b.choices[0].text] == reference[:2]
    counts = admission_counts(slo_gateway.address)
    assert counts.get(("refused", "custom")) == 1.0, counts
    wait_all_free(up)


def test_an_unreachable_first_token_is_refused_on_arrival(up, slo_gateway):
    """A TTFT below even the prefill of its own prompt on every replica is refused in `submit`, before
    the planner's next iteration: the 503 names the TTFT bound; a loose TPOT does not save it."""
    async def run():
        c = aclient(slo_gateway.address)
        try:
            return await c.completions.create(model="target", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"slo": {"ttft_ms": 0.001, "tpot_ms": 1e5}})
        except openai.APIStatusError as e:
            return e
        finally:
            await c.close()

    refused = asyncio.run(run())
    assert isinstance(refused, openai.InternalServerError) and refused.status_code == 503, refused
    assert int(refused.response.headers["retry-after"]) >= 1
    assert "TTFT SLO" in refused.response.json()["error"]["message"], refused.response.json()
    assert admission_counts(slo_gateway.address).get(("refused", "custom")) == 1.0
    wait_all_free(up)


@pytest.mark.parametrize("ask", [{"slo": {**IMPOSSIBLE, "best_effort": True}}, {"service_tier": "flex"}],
                         ids=["slo.best_effort", "service_tier=flex"])
def test_best_effort_is_served_exactly(up, slo_gateway, reference, ask):
    async def run():
        c = aclient(slo_gateway.address)
        r = await c.completions.create(model="target", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body=ask)  # the completions client has no service_tier argument
        await c.close()
        return r

    r = asyncio.run(run())
    assert r.choices[0].text == reference[2]
    if "slo" in ask:  # no SLO could be met, so it was served best effort
        counts = admission_counts(slo_gateway.address)
        assert counts.get(("best_effort", "custom")) == 1.0, counts
    wait_all_free(up)


def test_a_request_that_asks_for_no_slo_is_never_refused(up, reference):
    """The default class is unmeetable here (--slo-class chat=0.01): a request naming its tier is
    refused, the same request naming none runs best effort and equals transformers."""
    g = gateway(up, "none", "--budget", "24", "--admission", "slo", "--slo-class", "chat=0.01")
    try:
        async def run():
            c = aclient(g.address)
            plain = c.completions.create(model="target", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
            named = c.completions.create(model="target", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"service_tier": "chat"})
            out = await asyncio.gather(plain, named, return_exceptions=True)
            await c.close()
            return out

        plain, named = asyncio.run(run())
        assert not isinstance(plain, BaseException), plain
        assert plain.choices[0].text == reference[2]
        assert isinstance(named, openai.InternalServerError) and named.status_code == 503, named
        counts = admission_counts(g.address)
        assert counts.get(("best_effort", "chat")) == 1.0 and counts.get(("refused", "chat")) == 1.0, counts
    finally:
        g.stop()
    wait_all_free(up)


def test_preempted_requests_resume_exactly_and_free_every_block(reference):
    """A target pool too small for every request's worst case: with a 16-token look-ahead all are
    admitted, some are preempted when they outgrow it, resume by recompute and still equal
    transformers' greedy output; the preemptions are counted and no block is held at the end."""
    target = ServiceProcess("target", "--kv-blocks", "48")
    draft = ServiceProcess("draft")
    gw = ServiceProcess("gateway", "--draft", draft.address, "--target", target.address, "--policy", "chain:2",
                        "--budget", "24", "--kv-lookahead-tokens", "16")
    try:
        async def run():
            c = aclient(gw.address)
            out = await asyncio.gather(*[c.completions.create(model="target", prompt=PROMPTS[i % len(PROMPTS)],
                                                              max_tokens=MAX_TOKENS, temperature=0)
                                         for i in range(10)])
            await c.close()
            return [r.choices[0].text for r in out]

        texts = asyncio.run(run())
        assert texts == [reference[i % len(PROMPTS)] for i in range(10)]
        metrics = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{gw.address}/metrics").text)
                   for s in f.samples}
        assert metrics["vllm:num_preemptions_total"] > 0, "the pool was large enough: nothing was preempted"
        for address, kind in ((target.address, "target"), (draft.address, "draft")):
            stats = asyncio.run(_stats(kind, address))
            assert stats.free_blocks == stats.total_blocks and stats.resident_requests == 0, (kind, stats)
    finally:
        gw.stop()
        draft.stop()
        target.stop()


async def _stats(kind: str, address: str):
    client = await (TargetClient if kind == "target" else DraftClient).connect(address)
    try:
        # releases are sent at the start of the gateway's next iteration
        return await poll.until_async(client.stats, 10, f"the {kind} to hold nothing", interval_s=0.1,
                                      ok=lambda s: s.free_blocks == s.total_blocks and s.resident_requests == 0)
    finally:
        await client.close()


def test_best_effort_is_preempted_for_an_slo_request_and_resumes_exactly(up, reference):
    """One slot: a best-effort stream is running when an SLO request arrives (a named tier: it may not
    run best effort, so it is worth an eviction); the SLO request takes the slot (the best-effort one
    is preempted), and the best-effort stream resumes by recompute and still equals transformers."""
    g = gateway(up, "none", "--budget", "24", "--admission", "slo", "--router", "slo", "--max-running", "1")
    try:
        async def run():
            c = aclient(g.address)
            stream = await c.completions.create(model="target", prompt=PROMPTS[3], max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True,
                                                extra_body={"slo": {**IMPOSSIBLE, "best_effort": True}})
            text, arrived = "", asyncio.Event()

            async def consume():
                nonlocal text
                n = 0
                async for ch in stream:
                    text += ch.choices[0].text if ch.choices else ""
                    n += 1
                    if n == 3:
                        arrived.set()

            async def slo_request():
                await arrived.wait()
                return await c.completions.create(model="target", prompt=PROMPTS[4], max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body={"service_tier": "chat"})

            _, r = await asyncio.gather(consume(), slo_request())
            await c.close()
            return text, r.choices[0].text

        best_effort_text, slo_text = asyncio.run(run())
        assert slo_text == reference[4]
        assert best_effort_text == reference[3]
        metrics = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{g.address}/metrics").text)
                   for s in f.samples}
        assert metrics["vllm:num_preemptions_total"] >= 1
        wait_all_free(up)
    finally:
        g.stop()
