"""SLO-aware admission (`--admission slo`) through real processes and the official openai client.

- a request whose SLO no replica can meet is refused at once: 503 with Retry-After, the openai
  client's usual error type, before any byte of a stream; requests beside it are served exactly;
- the same request allowing best effort (`slo.best_effort`, or `service_tier: "flex"`) is served in the
  best-effort tier and equals transformers' greedy output;
- the outcomes are counted per tier in `specserve:admission_total`; no KV block is left reserved.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_procs import gateway
from tests.test_gateway import MAX_TOKENS, PROMPTS, aclient, wait_all_free

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
