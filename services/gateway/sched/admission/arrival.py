"""The arrival check's bound: the earliest a new request's first token can come, whatever the plan.

`Intake.submit` refuses a request with a TTFT SLO below it at once, before it waits for the planner
(slo.py), which a burst's requests would otherwise do for several iterations.
"""

from __future__ import annotations

import math

from specserve.gateway.perf.cost import PassCost


def first_token_bound_ms(prompt_tokens: int, tokens_ahead: int, costs: list[PassCost], chunk: int) -> float:
    """The earliest a new request's first token can come, ms: its prompt and `tokens_ahead` prompt tokens
    due before it, prefilled in passes of `chunk` tokens (or of all of them, if fewer) by every replica
    at once with nothing else in them (each replica's cost model at its fast prompt passes' pace: the
    p10 of their time against their price, no margin, no decode work). No plan that serves the prompts
    due before it first is likely to do better, so a request whose TTFT SLO is below this is refused on
    arrival (`Intake.submit`) instead of at the planner's next iterations: a burst's requests arrive
    faster than iterations run on a CPU."""
    total = prompt_tokens + tokens_ahead
    n = max(1, min(chunk, total))  # a lone short prompt is priced at its own pass, not at a chunk's share
    rate = sum(n / (c.iteration_ms(n) * (1.0 + c.fast_share())) for c in costs)  # prompt tokens per ms
    return total / rate if rate > 0 else math.inf


__all__ = ["first_token_bound_ms"]
