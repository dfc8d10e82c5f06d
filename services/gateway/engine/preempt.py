"""Which requests give their KV back when a replica runs short (preemption by recompute).

With `--kv-lookahead-tokens` a request reserves its context plus a bounded look-ahead instead of
prompt + max_tokens; when it outgrows that and its replica has no free blocks to grow it, requests
on that replica are preempted, lowest priority first: best effort before SLO requests, then the most
recently admitted (vLLM's rule). If the one that needs to grow comes first in that order, it is the
one preempted. A preempted request keeps its tokens; it waits again and rebuilds its KV with one
prefill over prompt + output (engine.py). No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Holder:
    rid: str
    blocks: int  # KV blocks it has reserved
    best_effort: bool  # admitted without an SLO
    admitted_at: float  # perf_counter seconds


def victims(holders: list[Holder], grower: str, need: int, free: int) -> list[str]:
    """The requests to preempt so that `grower` can take `need` more blocks beside `free` ones."""
    order = sorted(holders, key=lambda h: (not h.best_effort, -h.admitted_at))
    chosen: list[str] = []
    freed = 0
    for h in order:
        if h.rid == grower:
            return [grower]
        chosen.append(h.rid)
        freed += h.blocks
        if free + freed >= need:
            return chosen
    return [grower]


__all__ = ["Holder", "victims"]
