"""The latency model: how long one model pass takes, from the pass's composition alone.

    pass_ms = table(T) + per_request_ms * n + per_context_token_us / 1000 * sum(c_i)
              + per_pair_ns / 1e6 * sum(t_i * c_i)

T is the pass's new tokens (prefill chunk tokens, tree nodes, beam nodes), n its entries (requests),
t_i the new tokens of entry i and c_i the context it attends to (the tokens already in its KV):
the c_i term is the KV read (once per entry), the t_i c_i term the attention of many new tokens
over a long context (a later prefill chunk of a long prompt). table() is piecewise linear
through the given (tokens, ms) points: flat before the first point, the last segment's slope after
the last. This is the shape of Vidur's and SLOs-Serve's step-time models (linear work in the
tokens, a memory term in the KV read) with the token curve given as measured instead of as two
planes, so that it reproduces a `specserve profile` curve point for point.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyModel:
    tokens: tuple[int, ...]  # new tokens in the pass, strictly increasing, >= 1
    ms: tuple[float, ...]  # pass time at those token counts (with the reference composition), ms
    per_request_ms: float = 0.0  # extra time per entry in the pass, ms
    per_context_token_us: float = 0.0  # extra time per context token attended, summed over entries, us
    per_pair_ns: float = 0.0  # extra time per (new token, context token) pair, summed over entries, ns

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.ms):
            raise ValueError("a latency table needs as many `ms` values as `tokens` values, at least one")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or self.tokens[0] < 1:
            raise ValueError(f"latency table tokens must be increasing and >= 1, got {list(self.tokens)}")
        if any(m < 0 for m in self.ms) or min(self.per_request_ms, self.per_context_token_us, self.per_pair_ns) < 0:
            raise ValueError("latency model times must be >= 0")

    def table_ms(self, new_tokens: int) -> float:
        """The piecewise-linear token term alone."""
        xs, ys = self.tokens, self.ms
        if new_tokens <= xs[0] or len(xs) == 1:
            return ys[0]
        i = min(bisect.bisect_left(xs, new_tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (new_tokens - x0) / (x1 - x0)

    def pass_ms(self, entries: Sequence[tuple[int, int]]) -> float:
        """entries: (new tokens, context tokens) per entry of the pass."""
        if not entries:
            return 0.0
        new = sum(n for n, _ in entries)
        context = sum(c for _, c in entries)
        pairs = sum(n * c for n, c in entries)
        return (self.table_ms(new) + self.per_request_ms * len(entries) + self.per_context_token_us * context / 1e3
                + self.per_pair_ns * pairs / 1e6)
