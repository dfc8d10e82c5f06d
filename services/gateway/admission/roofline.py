"""The generalised roofline of SLOs-Serve (digest §3): a target pass's time from its composition.

    T̂(tokens, spec_steps, kv) = max over planes l of (k1_l · tokens + k2_l · spec_steps + k3_l · kv + b_l)

`tokens` is every token of the pass (prefill chunks and tree nodes, roots included); `spec_steps`
the deepest draft beam of the iteration (the draft runs its steps one after another before the
pass); `kv` the KV blocks the replica's running requests hold, a stand-in for the context the pass
attends to (ours, not the digest's; 0 in the profile). On the CPU replica short-prompt requests
decoding alone or beside other short ones took 11-18 ms a token, the same requests decoding beside
a 1,100-1,300-token search prompt 21-24 ms (docs/benchmarks.md, the overload runs): a plane
without it priced every small decode pass at the long contexts' cost.

Two planes in practice: a memory-bound one (shallow k1, b ≈ the weight read plus our three-service
round trips) and a compute-bound one (steep k1), split at the knee: a pass of at most
`knee` tokens is timed by the first (memory-bound) plane alone, a larger one by the max of all. The
split is where the planes are fitted, so the steep plane's line, fitted on large passes, never
prices a small one (on a CPU the curve is concave at its low end: a line through the large passes
lies above the small ones). The memory-bound line, refitted live from decode steps of 1-3 tokens,
can come out steep (3 ms a token on the real replica), and carried past the knee it caps every
batch (45 tokens in 149 ms) and refuses long prompts on an idle replica; timing larger passes by the
compute-bound plane alone was tried and measured worse under overload (docs/benchmarks.md: the
admitted requests then missed their TPOT), so the max stays until the compute-bound plane is fitted
over the passes it prices. Its inverse, `time2bs`, is the most tokens a pass may hold to finish
within a time; the planner fills every batch up to it.

Fitted from the profiled curve (`specserve profile`: median pass time per token count, measured
through the target service) and refitted online from the iteration records, whose `total_ms`
includes the draft call, the transport and the gateway's own time, as the digest's mapping asks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Plane:
    k1: float  # ms per token in the pass
    k2: float  # ms per sequential draft step
    b: float  # ms, fixed cost (weights, round trips)
    k3: float = 0.0  # ms per KV block held by the replica's running requests (the context attended)
    kv_seen: float = math.inf  # KV blocks: the most the fit saw; the term is not extrapolated beyond

    def kv_ms(self, kv: float) -> float:
        return self.k3 * min(kv, self.kv_seen)

    def time_ms(self, tokens: float, spec_steps: float, kv: float = 0.0) -> float:
        return self.k1 * tokens + self.k2 * spec_steps + self.kv_ms(kv) + self.b


Sample = tuple[int, int, float, int]  # (tokens in the pass, spec steps, iteration ms, KV blocks held)


@dataclass(slots=True)
class Roofline:
    planes: tuple[Plane, ...]
    knee: int = 1  # tokens: the planes split here when (re)fitted (the profile's budget B)
    window: int = 512  # live samples kept for the online refit
    refit_every: int = 64  # refit after this many new samples
    first_refit: int = 16  # the first refit comes after this many: the start is only the profile's guess
    samples: deque[Sample] = field(default_factory=deque)
    _since_fit: int = 0
    _refitted: bool = False

    def time_ms(self, tokens: int, spec_steps: int = 0, kv: int = 0) -> float:
        planes = self.planes[:1] if tokens <= self.knee else self.planes
        return max(p.time_ms(tokens, spec_steps, kv) for p in planes)

    def time2bs(self, time_ms: float, spec_steps: int = 0, kv: int = 0) -> int:
        """The most tokens one pass may hold and finish within `time_ms` (negative: not even one)."""
        low = _most(self.planes[0], time_ms, spec_steps, kv)
        if low <= self.knee or len(self.planes) == 1:
            return int(min(low, 1 << 20))  # a flat plane alone puts no bound on tokens
        high = min(_most(p, time_ms, spec_steps, kv) for p in self.planes[1:])
        return int(min(max(self.knee, min(low, high)), 1 << 20))  # up to the knee only the first plane counts

    # ---- fitting ---------------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Sequence[tuple[float, ...]], knee: int, margin: float = 0.9,
            low_margin: float = 0.5) -> Roofline:
        """Two planes split at the knee (tokens <= knee: memory-bound; above: compute-bound), each by
        least squares, with a quantile of the residuals added to b so the planner under-promises
        (digest §3, [Proposal]): `margin` (p90) for the compute-bound plane, whose passes carry
        prompt chunks (a TTFT is a few such passes), `low_margin` (the median) for the memory-bound
        one, whose passes are decode steps: a TPOT is judged as the mean over a request's tokens, so
        one slow step in ten averages out, and a p90 there ate the room of a TPOT class set at the
        profile's baseline (docs/benchmarks.md, "SLO-aware admission under load")."""
        pts = [s for s in samples if s[2] > 0]
        if not pts:
            raise ValueError("a roofline needs at least one timed sample")
        low = [s for s in pts if s[0] <= knee] or pts
        high = [s for s in pts if s[0] >= knee]
        planes = [_plane(low, low_margin)]
        if len(high) >= 2 and len({s[0] for s in high}) >= 2:
            planes.append(_plane(high, margin))
        return cls(tuple(planes), knee)

    def observe(self, tokens: int, spec_steps: int, ms: float, kv: int = 0) -> None:
        """A live sample (a whole iteration as the gateway timed it); refits every `refit_every`."""
        self.samples.append((tokens, spec_steps, ms, kv))
        if len(self.samples) > self.window:
            self.samples.popleft()
        self._since_fit += 1
        due = self.refit_every if self._refitted else self.first_refit
        if self._since_fit >= due and len({s[0] for s in self.samples}) >= 3:
            self._since_fit, self._refitted = 0, True
            self.planes = Roofline.fit(list(self.samples), self.knee).planes


def _most(p: Plane, time_ms: float, spec_steps: float, kv: float) -> float:
    """The most tokens plane `p` allows within `time_ms` (inf: a flat plane with room; negative: none)."""
    room = time_ms - p.b - p.k2 * spec_steps - p.kv_ms(kv)
    if p.k1 > 0:
        return math.floor(room / p.k1 + 1e-9)
    return math.inf if room >= 0 else -1.0


def _plane(samples: Sequence[tuple[float, ...]], margin: float) -> Plane:
    """Least squares over the columns the samples vary in (tokens, draft steps, KV blocks; a sample
    without its KV blocks holds none), slopes kept >= 0, then the `margin` quantile of the residuals
    added to the fixed cost.

    A fit whose fixed cost comes out negative has let a slope explain the weights' read, which no
    pass escapes: then the KV column (our stand-in), and after it the draft steps', is dropped and
    the rest fitted again. Live samples of one or two short requests vary in KV blocks by a block or
    two and in little else, and a slope through two such clusters once priced a pass at 6 ms per
    block held with no fixed cost, so a pass with nothing held cost nothing and one beside a request
    of 11 blocks could not hold a token: a waiting best-effort request was never admitted.

    The KV term stops at the most blocks the fit saw (`kv_seen`): on the real replica the
    compute-bound plane, refitted from short prompts' passes holding at most 28 blocks, once put
    1.17 ms on each block; carried to a 1,704-token prompt's 118 blocks it priced a pass of one
    token at 158 ms, past the 149 ms batch, and the prompt was refused on an idle replica."""
    x = np.array([[s[0], s[1], s[3] if len(s) > 3 else 0.0, 1.0] for s in samples], dtype=np.float64)
    y = np.array([s[2] for s in samples], dtype=np.float64)
    cols = [c for c in (0, 1, 2) if len(set(x[:, c].tolist())) >= 2]  # a constant column has no slope
    while True:
        coef, *_ = np.linalg.lstsq(x[:, [*cols, 3]], y, rcond=None)
        full = dict(zip([*cols, 3], coef.tolist(), strict=True))
        droppable = [c for c in (2, 1) if c in cols]
        if full[3] >= 0 or not droppable:
            break
        cols.remove(droppable[0])
    k1, k2, k3 = (max(full.get(c, 0.0), 0.0) for c in (0, 1, 2))
    b = full[3]
    resid = y - (k1 * x[:, 0] + k2 * x[:, 1] + k3 * x[:, 2] + b)
    b += float(np.quantile(resid, margin)) if len(resid) > 1 else 0.0
    return Plane(k1, k2, max(b, 0.0), k3, float(x[:, 2].max()) if k3 > 0 else math.inf)


__all__ = ["Plane", "Roofline", "Sample"]
