"""Reading the gateway's /metrics before and after a run: the iteration split and speculation rates.

Only the counters are used, as differences between two scrapes, so a gateway that already served
other runs gives the numbers of this run alone:

- iteration time in draft, target, transport and scheduling: `specserve:iteration_*_seconds_total`
  (draft and target are the time inside those services; transport is the rest of their calls);
- `specserve:iterations_total` for the mean iteration time;
- acceptance rate = accepted / draft tokens and mean acceptance length = 1 + accepted / drafts, as
  vLLM defines them from `vllm:spec_decode_num_*_total`.
"""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

PARTS = ("draft", "target", "transport", "schedule")


def parse_counters(text: str) -> dict[str, float]:
    """Sum of every sample of each sample name, over all label sets, from a text exposition (0.0.4).

    Keyed by the sample's own name, as written on its line (`vllm:prompt_tokens_total`,
    `..._bucket`, `..._sum`, `..._count`), not by the family name the parser groups it under
    (which has no `_total` for a counter). Text that is not a valid exposition raises ValueError."""
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    except ValueError as exc:
        raise ValueError(f"not a Prometheus text exposition: {exc}") from exc
    return out


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with session.get(f"{base_url}/metrics") as resp:
        resp.raise_for_status()
        return parse_counters(await resp.text())


def server_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server did between two scrapes: the iteration split and the speculation rates."""

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    seconds = {p: d(f"specserve:iteration_{p}_seconds_total") for p in PARTS}
    total = sum(seconds.values())
    iterations = d("specserve:iterations_total")
    drafts = d("vllm:spec_decode_num_drafts_total")
    draft_tokens = d("vllm:spec_decode_num_draft_tokens_total")
    accepted = d("vllm:spec_decode_num_accepted_tokens_total")
    return {
        "iteration": {
            "iterations": int(iterations),
            "mean_ms": total / iterations * 1e3 if iterations else None,
            "seconds": seconds,
            "share": {p: (s / total if total else None) for p, s in seconds.items()},
            "pass_seconds": d("specserve:iteration_pass_seconds_total"),  # the model pass, within "target"
        },
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "draft_tokens_per_iteration": draft_tokens / iterations if iterations else None,
    }
