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

With `padded_attention`, the c_i and t_i c_i terms count what a padded attention reads instead of
each entry's own context: this project's attention (shared/runtime/attention.py) runs entries in groups of
similar query length (shared.batch.attention_groups) and pads every entry of a group to the group's
longest query Q_g and longest key length, so entry i reads K_g = max_j (c_j + t_j) - Q_g keys and
pays for Q_g x K_g pairs. For a group of equal entries (every point of the fit) the two forms
agree; for 8 decodes of which one has a 1,500-token prompt, the padded form charges all eight for
1,500 keys. GPU presets leave it off: paged-attention kernels read each entry's own blocks.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.shared.runtime.batch import attention_groups


@dataclass(frozen=True, slots=True)
class LatencyModel:
    tokens: tuple[int, ...]  # new tokens in the pass, strictly increasing, >= 1
    ms: tuple[float, ...]  # pass time at those token counts (with the reference composition), ms
    per_request_ms: float = 0.0  # extra time per entry in the pass, ms
    per_context_token_us: float = 0.0  # extra time per context token attended, summed over entries, us
    per_pair_ns: float = 0.0  # extra time per (new token, context token) pair, summed over entries, ns
    padded_attention: bool = False  # context and pairs counted as padded per attention group (module doc)

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

    def features(self, entries: Sequence[tuple[int, int]]) -> tuple[int, int, int, int]:
        """(new tokens, entries, context tokens, pairs) of a pass, as the model counts them."""
        new = sum(n for n, _ in entries)
        if not self.padded_attention:
            return new, len(entries), sum(c for _, c in entries), sum(n * c for n, c in entries)
        context = pairs = 0
        for group in attention_groups([n for n, _ in entries]):
            q = max(entries[i][0] for i in group)
            k = max(entries[i][0] + entries[i][1] for i in group) - q
            context += len(group) * k
            pairs += len(group) * q * k
        return new, len(entries), context, pairs

    def pass_ms(self, entries: Sequence[tuple[int, int]]) -> float:
        """entries: (new tokens, context tokens) per entry of the pass."""
        if not entries:
            return 0.0
        new, n, context, pairs = self.features(entries)
        return (self.table_ms(new) + self.per_request_ms * n + self.per_context_token_us * context / 1e3
                + self.per_pair_ns * pairs / 1e6)
