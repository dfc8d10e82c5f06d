"""Helpers for a target model's forward-latency profile (latency of one pass vs tokens in it).

`knee` is what AdaServe's per-pass token budget B is fitted on: bench/forward_latency.py prints
it, and `specserve profile` reuses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["knee"]


def knee(points: Mapping[int, float] | Iterable[tuple[int, float]], tolerance: float = 1.25) -> int:
    """The largest token count whose latency is within `tolerance` x the 1-token latency.

    points: (num_tokens, latency) pairs, or a {num_tokens: latency} mapping, in any order and in
    any time unit (normally the median latency of one forward pass). The baseline is the latency
    at the smallest token count, which should be 1; it always qualifies, so a curve that rises
    past the tolerance right away gives that count (1). Every point is considered, not only the
    first run of flat ones: a later count that is back within the tolerance still counts.

    >>> knee({1: 10.0, 8: 10.5, 64: 12.0, 128: 12.5, 256: 20.0})
    128
    """
    pairs = sorted((points.items() if isinstance(points, Mapping) else points), key=lambda p: p[0])
    if not pairs:
        raise ValueError("knee() needs at least one (num_tokens, latency) point")
    if tolerance < 1.0:
        raise ValueError(f"tolerance must be >= 1.0, got {tolerance}")
    base_tokens, base_latency = pairs[0]
    if base_latency <= 0:
        raise ValueError(f"the {base_tokens}-token latency must be positive, got {base_latency}")
    limit = tolerance * base_latency
    return max(int(n) for n, latency in pairs if latency <= limit)
