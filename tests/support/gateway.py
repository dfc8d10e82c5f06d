"""The gateway as the stack tests drive it over HTTP: the demo prompts, the official openai clients,
greedy completions and transformers' reference for them, and the KV check every stack test ends with
(both services, or every replica, hold nothing)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai

from specserve.shared.wire.service_client import DraftClient, TargetClient
from tests.support import poll
from tests.support.procs import Up, gateway

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "target"
_SHORT = [json.loads(line)["prompt"] for line in (ROOT / "bench/workloads/short.jsonl").read_text().splitlines()]
# Six prompts the demo target continues for 40+ tokens, then one it ends at once (EOS first).
PROMPTS = [_SHORT[i] for i in (1, 2, 5, 6, 7, 8, 0)]
MAX_TOKENS = 40
POLICIES = ["none", "chain:4", "tree:1,1,3,1,1,1,1,1", "equal-greedy", "global-greedy", "tetris:3,1", "turbospec",
            "nightjar", "slo-goodput", "joint"]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def aclient(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


async def greedy_results(url: str, prompts: list[str], **kw) -> list:
    """The greedy completions of `prompts`, all at once, whole (text, usage, the `specserve` report)."""
    c = aclient(url)
    results = await asyncio.gather(*[c.completions.create(model="target", prompt=p, max_tokens=MAX_TOKENS,
                                                          temperature=0, **kw) for p in prompts])
    await c.close()
    return results


async def complete_all(url: str, prompts: list[str], **kw) -> list[str]:
    return [r.choices[0].text for r in await greedy_results(url, prompts, **kw)]


async def run_all(url: str, prompts: list[str], **kw) -> list:
    """greedy_results, with a failed request's exception in its place instead of raised."""
    c = aclient(url)
    try:
        return await asyncio.gather(*[c.completions.create(model="target", prompt=p, max_tokens=MAX_TOKENS,
                                                           temperature=0, **kw) for p in prompts],
                                    return_exceptions=True)
    finally:
        await c.close()


def transformers_greedy() -> list[str]:
    """Greedy output of the target alone on PROMPTS, with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype="float32").eval()
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt")["input_ids"]
        gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)  # EOS from generation_config
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


async def service_stats(up: Up) -> list:
    """The Stats of `up`'s draft, then of its target (or of each of its replicas, `target-0`, `target-1`, ...)."""
    services = [(DraftClient, up.draft)] + [(TargetClient, address) for name, address in up.addresses.items()
                                            if name == "target" or name.startswith("target-")]
    out = []
    for cls, address in services:
        c = await cls.connect(address)
        out.append(await c.stats())
        await c.close()
    return out


def wait_all_free(up: Up, timeout_s: float = 30) -> None:
    """Wait until the draft and every target of `up` hold no request and no KV block."""
    poll.until(lambda: asyncio.run(service_stats(up)), timeout_s, "every KV block freed, no request resident",
               ok=lambda stats: all(s.free_blocks == s.total_blocks and s.resident_requests == 0 for s in stats),
               interval_s=0.3)


def every_policy_is_lossless(up: Up, reference: list[str]) -> None:
    """A gateway per policy of POLICIES on `up`'s services gives `reference` (greedy) on PROMPTS; then
    every KV block is free."""
    for policy in POLICIES:
        g = gateway(up, policy, "--budget", "24")
        try:
            assert asyncio.run(complete_all(g.address, PROMPTS)) == reference, policy
        finally:
            g.stop()
    wait_all_free(up)


def up_profile(up: Up) -> str:
    """The profile file `up`'s gateway was started on (another `up` can start on it without measuring)."""
    return httpx.get(f"{up.url}/v1/slo_classes").json()["profile"]
