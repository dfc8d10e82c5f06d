"""Prefix caching through the whole stack (`specserve up`, the official openai client): a second request
with the same long prefix is served from the target's prefix cache (the response's
`usage.prompt_tokens_details.cached_tokens`, vLLM's counters) and gives the greedy output it gives with
caching off, under `--policy none`, `chain:4` and the default; a small KV pool evicts cached blocks and
leaks none."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from specserve.shared.wire.service_client import TargetClient
from tests.support.fixtures import start_up
from tests.support.gateway import ROOT, aclient, service_stats, up_profile, wait_all_free
from tests.support.procs import Up, gateway

_MEDIUM = [json.loads(line)["prompt"] for line in (ROOT / "bench/workloads/medium.jsonl").read_text().splitlines()]
PREFIX = _MEDIUM[0]  # a few hundred tokens of the demo vocabulary
TAILS = ["\n\ndef first(x):\n    return", "\n\nclass Second:\n    def __init__(self):\n        self."]
OTHERS = _MEDIUM[1:7]  # distinct prompts that fill the small pool and evict
MAX_TOKENS = 24
KV_BLOCKS = 80  # a small target pool (16-token blocks): a few requests' worth, so cached blocks are evicted
OFF = {"SPECSERVE_TARGET_PREFIX_CACHING": "0", "SPECSERVE_DRAFT_PREFIX_CACHING": "0"}


@pytest.fixture(scope="module")
def uncached_up(request, suite_profile) -> Up:
    """`up` with prefix caching off in both services (it measures the suite's profile if none is there yet)."""
    return start_up(request, profile=suite_profile, env={**os.environ, **OFF})


@pytest.fixture(scope="module")
def cached_up(request, suite_profile, uncached_up) -> Up:
    """`up` with its default prefix caching, on a small target pool (too small to measure a profile on)."""
    return start_up(request, profile=suite_profile, env={**os.environ, "SPECSERVE_TARGET_KV_BLOCKS": str(KV_BLOCKS)})


async def _complete(url: str, prompt: str) -> tuple[str, int, int]:
    """One greedy completion: its text, the prompt tokens the response says were cached, and the prompt's."""
    c = aclient(url)
    try:
        r = await c.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    finally:
        await c.close()
    details = r.usage.prompt_tokens_details
    return r.choices[0].text, (details.cached_tokens or 0) if details is not None else 0, r.usage.prompt_tokens


def _in_turn(url: str, prompts: list[str]) -> list[tuple[str, int, int]]:
    """The prompts one after another (each finds the cache the ones before it left)."""
    async def run() -> list[tuple[str, int, int]]:
        return [await _complete(url, p) for p in prompts]
    return asyncio.run(run())


def _texts(results: list[tuple[str, int, int]]) -> list[str]:
    return [text for text, _, _ in results]


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


async def _target_stats(up: Up):
    c = await TargetClient.connect(up.target)
    try:
        return await c.stats()
    finally:
        await c.close()


def test_a_shared_prefix_is_served_from_the_cache_with_the_same_output(cached_up: Up, uncached_up: Up) -> None:
    import httpx
    from transformers import AutoTokenizer

    prompts = [PREFIX + tail for tail in TAILS]
    ids = [AutoTokenizer.from_pretrained(ROOT / "models" / "target")(p)["input_ids"] for p in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)  # leading tokens the two prompts share
    reference = _in_turn(uncached_up.url, prompts)
    assert [cached for _, cached, _ in reference] == [0, 0]
    assert asyncio.run(_target_stats(uncached_up)).cached_blocks == 0
    before = httpx.get(f"{cached_up.url}/metrics").text
    outputs = {}
    for policy in ("none", "chain:4", "default"):
        g = None if policy == "default" else gateway(cached_up, policy, "--budget", "24", "--profile",
                                                     up_profile(cached_up))
        try:
            outputs[policy] = _in_turn(cached_up.url if g is None else g.address, prompts)
        finally:
            if g is not None:
                g.stop()
    for policy, got in outputs.items():
        assert _texts(got) == _texts(reference), policy
        assert got[1][1] >= 16 * (shared // 16) // 2, (policy, got)  # most of the shared prefix, at least
    # the first gateway's mirror knew the first prompt's blocks: the second took every whole one it shares
    assert outputs["none"][1][1] == min(shared, len(ids[1]) - 1) // 16 * 16
    assert outputs["none"][0][1] == 0 and outputs["chain:4"][0][1] > 0  # once a request has left it there
    after = httpx.get(f"{cached_up.url}/metrics").text  # the default gateway's own requests
    hits = _metric(after, "vllm:prefix_cache_hits_total") - _metric(before, "vllm:prefix_cache_hits_total")
    queries = _metric(after, "vllm:prefix_cache_queries_total") - _metric(before, "vllm:prefix_cache_queries_total")
    assert hits == sum(cached for _, cached, _ in outputs["default"]) > 0
    assert queries == sum(n for _, _, n in outputs["default"])  # every prompt token queried once
    wait_all_free(cached_up)


def test_a_small_pool_evicts_and_leaks_nothing(cached_up: Up, uncached_up: Up) -> None:
    first, second = _in_turn(cached_up.url, [PREFIX, PREFIX])
    assert second[0] == first[0] and second[1] == (second[2] - 1) // 16 * 16
    reference = _in_turn(uncached_up.url, OTHERS)

    async def together(url: str) -> list[tuple[str, int, int]]:
        return list(await asyncio.gather(*[_complete(url, p) for p in OTHERS]))

    assert _texts(asyncio.run(together(cached_up.url))) == _texts(reference)
    assert _texts(_in_turn(cached_up.url, OTHERS)) == _texts(reference)
    wait_all_free(cached_up)
    for stats in asyncio.run(service_stats(cached_up)):  # nothing held: every cached block is evictable
        assert stats.free_blocks == stats.total_blocks and stats.evictable_blocks == stats.cached_blocks
    assert 0 < asyncio.run(_target_stats(cached_up)).cached_blocks <= KV_BLOCKS
    again = _in_turn(cached_up.url, [PREFIX])[0]
    assert again[0] == first[0] and again[1] < second[1]  # newer prompts filled the pool: its blocks were evicted
    wait_all_free(cached_up)
