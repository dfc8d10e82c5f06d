"""Nightjar's draft offload and reload under load, on the real services: no request is lost, the output
stays the target's greedy output, and no KV block leaks in either service.

The thresholds are set from the target's pool so that the transitions happen in a short test: with
`--max-running 2` and seven concurrent requests, two run and the rest wait (pressure: offload), and
once nobody waits and one request runs the unreserved fraction is above the reload threshold
(reload, with that request still decoding). Whether a burst's tail leaves one request decoding alone
depends on the order the requests arrive in, so a lone request follows the burst: it reloads the
draft at its second iteration if the tail did not. A second burst then starts on the reloaded draft
and offloads it again.
"""

from __future__ import annotations

import asyncio
import math

from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.gateway import PROMPTS, TARGET, aclient, service_stats, wait_all_free
from tests.support.procs import gateway

TREE_TOKENS = 64  # the gateway reserves prompt + max_tokens + 64 tree tokens per request
LENGTHS = [40, 24, 36, 16, 40, 30, 40]  # max_tokens per prompt (the last prompt ends at EOS at once)


def greedy_reference() -> list[str]:
    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype="float32").eval()
    out = []
    for p, n in zip(PROMPTS, LENGTHS, strict=True):
        ids = tok(p, return_tensors="pt")["input_ids"]
        gen = model.generate(ids, max_new_tokens=n, do_sample=False)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


async def complete_one(url: str, prompt: str, n: int) -> str:
    c = aclient(url)
    r = await c.completions.create(model="target", prompt=prompt, max_tokens=n, temperature=0)
    await c.close()
    return r.choices[0].text


async def complete_varied(url: str) -> list[str]:
    c = aclient(url)
    results = await asyncio.gather(*[c.completions.create(model="target", prompt=p, max_tokens=n, temperature=0)
                                     for p, n in zip(PROMPTS, LENGTHS, strict=True)])
    await c.close()
    return [r.choices[0].text for r in results]


def test_offload_and_reload_under_load_lose_no_request_and_leak_no_block(up):
    reference = greedy_reference()
    draft, target = asyncio.run(service_stats(up))
    assert not draft.offloaded
    tok = AutoTokenizer.from_pretrained(TARGET)
    blocks = sorted(math.ceil((len(tok(p)["input_ids"]) + n + TREE_TOKENS) / target.block_size)
                    for p, n in zip(PROMPTS, LENGTHS, strict=True))
    one, two = blocks[-1], blocks[0] + blocks[1]
    assert one < two
    threshold = 1 - (one + two) / 2 / target.total_blocks  # 2 running: below; 1 running: above
    g = gateway(up, "nightjar:0x1,2x1,3x1", "--budget", "24", "--max-running", "2",
                "--nightjar-offload-free", f"{threshold:.9f}", "--nightjar-reload-free", f"{threshold:.9f}",
                "--nightjar-persist", "2", "--nightjar-dwell-s", "0.2")
    try:
        assert asyncio.run(complete_varied(g.address)) == reference  # burst 1: offload (and maybe reload)
        draft, _ = asyncio.run(service_stats(up))
        assert draft.last_offload_s > 0, draft
        assert asyncio.run(complete_one(g.address, PROMPTS[0], LENGTHS[0])) == reference[0]  # alone: reload
        draft, _ = asyncio.run(service_stats(up))
        assert draft.last_reload_s > 0, draft
        assert not draft.offloaded
        assert asyncio.run(complete_varied(g.address)) == reference  # burst 2 on the reloaded draft
        wait_all_free(up)
    finally:
        g.stop()
