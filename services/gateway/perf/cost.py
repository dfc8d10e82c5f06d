"""PassCost: one target replica's iteration time, the gateway's only cost model.

The admission planner (admission/), the speculation policies (policy/) and the router read it; the
engine feeds it once per iteration from the `IterationRecord` (`sample_of`, then `observe`). No I/O,
no clock.

An iteration on our three-service path, for a replica whose pass holds `tokens` tokens (prompt
chunks and tree nodes, roots included) while its requests hold `kv` KV blocks, with a draft call of
depth d and width w for `spec` requests that catch up `lag` committed tokens:

    T = R_t + target(tokens, kv) + T_gw + [d > 0 and spec > 0] (R_d + draft(d, spec, w, lag) + T_gw,d - T_gw)

- `target(tokens, kv)`: the target service's time. At a token count it has timed, the moving
  average of those passes; between timed counts, interpolated; beyond them, from the nearest timed
  count by the profile's lone-request chains (`single`: 1..8 tokens) up to their largest count, and a
  line c0 + c1 * tokens beyond (fitted from the profile's curve, refitted online with the profile as a
  prior that keeps the weight of LINE_PRIOR_PASSES passes). A line alone is wrong at small counts on a
  CPU, where a 1-token pass takes a cheap matrix-vector path and a 2-token pass costs less than the
  batch-8 curve's slope adds: priced by the line, one request never drafts there. A pass at or above
  the least timed count enters the table (and the line) at most OUTLIER_FACTOR times what it was
  priced at: a count timed once (a 256-token chunk at concurrency 1) would otherwise keep one stalled
  pass's time for good. The context term k_kv * (kv - kv at that count) corrects for the KV held;
  k_kv is fitted on the variation at one token count (so the token count, which grows with the batch
  as the KV does, cannot take its place) of the passes without a prompt (a chunk's attention grows with
  its tokens times its context: fitted on chunks too, the slope once priced a 1-token pass beside 80
  blocks at 40 ms on a CPU whose such passes take 6), and is not carried beyond the least and most
  blocks seen (a slope through two clusters a block apart once priced a pass with no context at nothing).
- `draft(d, spec, w, lag) = e0 + e1 d + e2 d spec w + e3 lag`, fitted online from the draft's service time.
- R_t, R_d: moving averages of each call's round trip beyond the service's own time; T_gw: the
  gateway's own share of an iteration without a draft call (record.schedule_ms), T_gw,d of one with a draft call
  (its trees selected and built: several times the plain share at 64 decoding on a CPU), each from its own kind of
  iteration, so a policy that drafts does not raise its own price of a step without drafts (until one kind is
  seen, the other's stands in for it).

Before the first timed pass the table holds one point: the profile's baseline (a whole decode
iteration at batch 8, round trips included) at 8 tokens. The profile's curve points are verify
passes timed while the contexts grew (27.0 ms at 8 tokens on the CPU profile, against an 18.6 ms
baseline and 16-17 ms live lone decode steps), so they set the line's slope only.

Every iteration is priced before it is fitted: `errors` keeps the relative error |T - T̂| / T of
those out-of-sample predictions (`error_summary`, served in the gateway's /v1/slo_classes), and
`residuals` the signed error by kind of pass, from which the planner's margin comes (`planned_ms`):
for a pass of at most B tokens, the median residual of the passes that carried no prompt (decode
steps, speculative ones with their draft call included: a TPOT is a mean over a request's tokens, so
one slow step in ten averages out); above B, the p90 of the residual as a share of the pass priced,
over the passes that carried a prompt chunk (a TTFT is a few such passes; a share, because a pass's
error grows with its size, so a large chunk's slowness is not added whole to a small pass; and not
the speculative decode passes, whose draft call's spread says nothing of a chunk's). `time2bs` is
the inverse the planner fills its batches with.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specserve.gateway.perf.quantiles import SortedWindow
from specserve.gateway.perf.record import IterationRecord

ANCHOR_TOKENS = 8  # the profile's baseline is a decode iteration at batch 8 (profile.BATCH)
DRAFT_STEP_SHARE = 0.15  # the draft's prior: one beam step costs this share of the baseline iteration
MAX_PASS_TOKENS = 1 << 20  # time2bs never answers more
LOW_QUANTILE, HIGH_QUANTILE = 0.5, 0.9  # the planner's margin for passes of <= B tokens (ms) and above (a share)
FAST_QUANTILE = 0.1  # the arrival check's bound: prompt passes this fast, as a share of their price
ERROR_WINDOW = 20_000  # iterations whose prediction error `error_summary` reports
LINE_PRIOR_PASSES = 20.0  # the profile's line weighs as this many passes (the data's weight tops out near 50)
OUTLIER_FACTOR = 3.0  # a pass enters the table at most this many times the time it was priced at


class OnlineLinear:
    """y = theta . x, a ridge regression toward `prior` with exponential forgetting (closed form, small n)."""

    def __init__(self, prior: list[float], prior_weight: float = 1.0, decay: float = 0.98,
                 prior_points: list[list[float]] | None = None):
        """prior_points: the prior weighs as `prior_weight` observations spread over these x (which do not
        decay), instead of `prior_weight` on each coefficient: a slope's prior then means as much as the
        range it was measured over, whatever the units of x."""
        self.prior = list(prior)
        self.decay = decay
        n = len(prior)
        if prior_points:
            x = np.asarray(prior_points, dtype=np.float64)
            self.precision = prior_weight * (x.T @ x) / len(x)
        else:
            self.precision = prior_weight * np.eye(n)
        self.xtx = np.zeros((n, n))
        self.xty = np.zeros(n)
        self._theta: list[float] | None = list(prior)

    def observe(self, x: list[float], y: float, weight: float = 1.0) -> None:
        v = np.asarray(x, dtype=np.float64)
        self.xtx = self.xtx * self.decay + weight * np.outer(v, v)
        self.xty = self.xty * self.decay + weight * v * y
        self._theta = None  # solved when next read: most passes are priced from the table, not the line

    @property
    def theta(self) -> list[float]:
        if self._theta is None:
            theta = np.linalg.solve(self.xtx + self.precision, self.xty + self.precision @ np.asarray(self.prior))
            self._theta = [max(0.0, float(t)) for t in theta]  # no coefficient is negative time
        return self._theta

    @theta.setter
    def theta(self, value: list[float]) -> None:  # until the next observation
        self._theta = list(value)

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))


@dataclass(frozen=True, slots=True)
class PassSample:
    """What one iteration says about one replica (`sample_of` reads it from the record)."""

    tokens: int  # in the replica's pass: prompt chunks and tree nodes, roots included
    service_ms: float  # inside the target service
    call_ms: float  # the Forward call as the gateway saw it
    total_ms: float  # the whole iteration
    schedule_ms: float  # the gateway's own part of it
    kv: int = 0  # KV blocks the replica's requests held
    prompt: int = 0  # prompt tokens among `tokens`
    decoded: bool = True  # some request on this replica decoded (else the iteration says nothing of t_spec)
    depth: int = 0  # the draft call: deepest beam
    spec: int = 0  # entries with d > 0
    width: int = 1  # widest beam
    lag: int = 0  # committed tokens the draft caught up in the call
    draft_service_ms: float = 0.0
    draft_call_ms: float = 0.0


def sample_of(record: IterationRecord, replica: int, kv: int = 0) -> PassSample | None:
    """This replica's part of an iteration; None when it had no pass, its call failed, or its pass or the draft
    call captured a CUDA graph (a first pass of its shape, on a GPU tens of times a replay: it would inflate the
    fit and the margins for a shape whose every later pass is a replay)."""
    mine = next((r for r in record.replicas if r.replica == replica and r.failure is None), None)
    if mine is None or mine.warmup or record.draft.warmup:
        return None
    d = record.draft
    drafted = d.requests > 0 and d.failure is None and d.service_ms > 0
    beams = [s for s in record.requests if s.depth > 0]
    return PassSample(
        tokens=mine.prefill_tokens + mine.tree_nodes, service_ms=mine.service_ms, call_ms=mine.call_ms,
        total_ms=record.total_ms, schedule_ms=record.schedule_ms, kv=kv, prompt=mine.prefill_tokens,
        decoded=any(s.replica == replica and s.verified for s in record.requests),
        depth=max((s.depth for s in beams), default=0) if drafted else 0, spec=d.requests if drafted else 0,
        width=max((s.width for s in beams), default=1), lag=d.lag,
        draft_service_ms=d.service_ms if drafted else 0.0, draft_call_ms=d.call_ms if drafted else 0.0)


def _margin_value(prompt: bool, residual: float, priced: float) -> float:
    """What the margin's quantiles read of a residual: ms without a prompt, a share of the price with one."""
    return residual / max(priced, 1e-3) if prompt else residual


def _ema(old: float, new: float, weight: float) -> float:
    return new if old < 0 else old + weight * (new - old)


def most_tokens(planned: Callable[[int], float], time_ms: float) -> int:
    """The most tokens one pass may hold for `planned(tokens)` (a `PassCost.pricer`) to be within `time_ms`
    (0: not one): doubling, then bisection."""
    bound = time_ms + 1e-9
    if planned(1) > bound:
        return 0
    lo, hi = 1, 2
    while hi <= MAX_PASS_TOKENS and planned(hi) <= bound:
        lo, hi = hi, hi * 2
    if hi > MAX_PASS_TOKENS:
        return MAX_PASS_TOKENS
    while hi - lo > 1:  # planned(lo) fits, planned(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if planned(mid) <= bound else (lo, mid)
    return lo


class PassCost:
    """One replica's iteration time (ms) as a function of its pass, its context and the draft call."""

    def __init__(self, budget_tokens: int, baseline_iteration_ms: float, curve: list[tuple[int, float]] | None = None,
                 *, single: list[tuple[int, float]] | None = None, smoothing: float = 0.2, t_spec_ms: float = 0.0,
                 window: int = 512):
        self.budget_tokens = budget_tokens  # B: tokens per target pass, roots included (the profile's)
        self.baseline_iteration_ms = baseline_iteration_ms  # the profile's decode iteration at batch 8
        self.curve = list(curve or [])  # (tokens in a target pass, median ms): the profile's
        self.smoothing = smoothing  # weight of the newest iteration in every moving average
        self.t_spec_ms = t_spec_ms if t_spec_ms > 0 else baseline_iteration_ms  # moving average of iterations
        # the profile's lone-request chains (tokens, ms), never falling with the tokens: the shape of small passes
        points = sorted(single or [])
        self.single = ([float(n) for n, _ in points],
                       np.maximum.accumulate(np.array([ms for _, ms in points], dtype=np.float64)).tolist())
        c0, c1 = _line(self.curve, baseline_iteration_ms)
        # the line's prior weighs like LINE_PRIOR_PASSES passes spread over the profile's curve, and never
        # decays: passes of a few tokens alone (concurrency 1) cannot tilt the slope it extrapolates with
        self.line = OnlineLinear([c0, c1], prior_weight=LINE_PRIOR_PASSES,
                                 prior_points=[[1.0, float(n)] for n, _ in self.curve] if len(self.curve) > 1 else None)
        self.seen: dict[int, tuple[float, float]] = {}  # tokens -> moving averages of (service ms, kv blocks)
        self._keys: list[int] = []
        self.kv_slope = [0.0, 0.0]  # decayed sums of d_kv * d_ms and d_kv ** 2 at one token count
        self.kv_min, self.kv_max = 0, 0  # the least and most KV blocks a timed pass held: the term stays within
        step = DRAFT_STEP_SHARE * max(baseline_iteration_ms, 1e-3)
        self.draft = OnlineLinear([0.5, step, step / 16, 0.05], prior_weight=2.0)
        self.r_t = -1.0  # target round trip beyond its service time, ms (-1: not seen yet)
        self.r_d = -1.0  # draft round trip
        self.gateway = -1.0  # the gateway's own part of an iteration without a draft call
        self.gateway_drafted = -1.0  # and of one with a draft call (-1: not seen yet)
        self.spec = -1.0  # moving average of the draft call's requests (the planner's draft term)
        self.lag = -1.0  # and of its catch-up tokens
        self.residuals: deque[tuple[bool, float, float]] = deque(maxlen=window)  # (a prompt in it, T - T̂, T̂), ms
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # |T - T̂| / T
        # the residuals sorted, as the margin reads them: ms of the passes without a prompt; share of their
        # price for those with one
        self._low, self._high = SortedWindow(), SortedWindow()
        self._margins: tuple[float, float, float] | None = None

    # ---- prediction ----------------------------------------------------------------------------------
    @property
    def kv_ms_per_block(self) -> float:
        sxy, sxx = self.kv_slope
        return max(0.0, sxy / (sxx + 1.0))  # one pseudo-observation of no slope

    def target_ms(self, tokens: int, kv: int = 0) -> float:
        """The target service's time for a pass of `tokens` tokens beside `kv` KV blocks held."""
        return self._target_curve(kv)(tokens)

    def _target_curve(self, kv: int) -> Callable[[int], float]:
        """`target_ms(., kv)` as a function of the tokens, what does not depend on them worked out once (valid
        until the next observation)."""
        kv = min(max(kv, self.kv_min), self.kv_max)  # the context term stays within the blocks timed
        seen = self.seen or {ANCHOR_TOKENS: (self.baseline_iteration_ms, float(kv))}
        keys = self._keys if self.seen else [ANCHOR_TOKENS]
        k_kv = self.kv_ms_per_block
        shape = self._shape_curve()

        def at(n: int) -> float:
            ms, n_kv = seen[n]
            return ms + k_kv * (kv - n_kv)

        def curve(tokens: int) -> float:
            if tokens in seen:
                return max(1e-3, at(tokens))
            i = bisect.bisect_left(keys, tokens)
            if 0 < i < len(keys):
                x0, x1 = keys[i - 1], keys[i]
                return max(1e-3, at(x0) + (at(x1) - at(x0)) * (tokens - x0) / (x1 - x0))
            near = keys[0] if i == 0 else keys[-1]
            return max(1e-3, at(near) + shape(tokens) - shape(near))
        return curve

    def _shape_curve(self) -> Callable[[int], float]:
        """A pass's time up to a constant, as a function of its tokens: the lone-request chains' times up to their
        largest count, the line's slope beyond (and throughout, without them)."""
        xs, ys = self.single
        slope = float(self.line.theta[1])
        if len(xs) < 2:
            return lambda tokens: slope * tokens
        top = xs[-1]
        return lambda tokens: _interp(min(tokens, top), xs, ys) + slope * max(0.0, tokens - top)

    def draft_ms(self, depth: int, spec: int, width: int, lag: int) -> float:
        return self.draft.predict([1.0, float(depth), float(depth * spec * width), float(lag)])

    def iteration_ms(self, tokens: int, depth: int = 0, spec: int = 0, width: int = 1, lag: int = 0,
                     kv: int = 0) -> float:
        """The iteration: the target pass over `tokens`, the draft call when d > 0 and anyone drafts, the rest."""
        return self._iteration_curve(depth, spec, width, lag, kv)(tokens)

    def iteration_table(self, rows: list[tuple[int, int, int, int]], width: int = 1, kv: int = 0) -> list[float]:
        """`iteration_ms(tokens, depth, spec, width, lag, kv)` of each (tokens, depth, spec, lag) row, the target's
        curve at `kv` worked out once for all of them."""
        target = self._target_curve(kv)
        return [self._iteration_curve(depth, spec, width, lag, kv, target)(tokens) for tokens, depth, spec, lag in rows]

    def _iteration_curve(self, depth: int, spec: int, width: int, lag: int, kv: int,
                         target: Callable[[int], float] | None = None) -> Callable[[int], float]:
        """`iteration_ms(., depth, spec, width, lag, kv)` as a function of the tokens (as `_target_curve`; `target`:
        `_target_curve(kv)`, when the caller has it)."""
        target, r_t = target or self._target_curve(kv), max(self.r_t, 0.0)
        plain, drafted = self.gateway, self.gateway_drafted
        if not (depth > 0 and spec > 0):
            gateway = max(plain if plain >= 0 else drafted, 0.0)
            return lambda tokens: max(r_t + target(tokens) + gateway, 1e-3)
        gateway = max(drafted if drafted >= 0 else plain, 0.0)
        draft = max(self.r_d, 0.0) + self.draft_ms(depth, spec, width, lag)
        return lambda tokens: max(r_t + target(tokens) + gateway + draft, 1e-3)

    # ---- the planner's view --------------------------------------------------------------------------
    def margin_ms(self, tokens: int, priced_ms: float) -> float:
        """What the planner adds to a pass of `tokens` priced at `priced_ms`: up to B tokens, the median
        recent residual of the passes without a prompt, ms; above, the p90 of the residuals of the passes
        with one as a share of their price, times this one's (>= 0)."""
        return self._margin_stats()[0] if tokens <= self.budget_tokens else self.slow_share() * priced_ms

    def slow_share(self) -> float:
        """How much slower than priced the slow prompt passes ran: the p90 of their residuals as a share of
        their price (>= 0; the planner's margin for passes above B tokens)."""
        return self._margin_stats()[1]

    def fast_share(self) -> float:
        """How much faster than priced the fast prompt passes ran: the p10 of their residuals as a share of
        their price (<= 0; the arrival check's bound prices prompt passes at 1 + this)."""
        return self._margin_stats()[2]

    def _margin_stats(self) -> tuple[float, float, float]:
        if self._margins is None:
            low, high = self._low, self._high
            self._margins = (max(0.0, low.quantile(LOW_QUANTILE)) if low else 0.0,
                             max(0.0, high.quantile(HIGH_QUANTILE)) if high else 0.0,
                             max(-0.9, min(0.0, high.quantile(FAST_QUANTILE))) if high else 0.0)
        return self._margins

    def _keep_residual(self, prompt: bool, residual: float, priced: float) -> None:
        """The newest pass's residual into the window and its sorted view, the oldest out when it is full."""
        if len(self.residuals) == self.residuals.maxlen:
            gone = self.residuals[0]
            (self._high if gone[0] else self._low).remove(_margin_value(*gone))
        self.residuals.append((prompt, residual, priced))
        (self._high if prompt else self._low).add(_margin_value(prompt, residual, priced))
        self._margins = None

    def planned_ms(self, tokens: int, spec_steps: int = 0, kv: int = 0, margin: bool = True) -> float:
        """An iteration as the planner prices it: `spec_steps` deep drafting for the usual draft call,
        plus the margin (without it: the expected time)."""
        return self.pricer(spec_steps, kv, margin)(tokens)

    def pricer(self, spec_steps: int = 0, kv: int = 0, margin: bool = True) -> Callable[[int], float]:
        """`planned_ms(., spec_steps, kv, margin)` as a function of the tokens, what does not depend on them
        worked out once and each count's price kept: valid until the next observation (a planning call's
        searches use one)."""
        spec = round(max(self.spec, 1.0)) if spec_steps > 0 else 0
        priced = self._iteration_curve(spec_steps, spec, 1, round(max(self.lag, 0.0)), kv)
        low, share, budget = self._margin_stats()[0], self.slow_share(), self.budget_tokens
        memo: dict[int, float] = {}

        def planned(tokens: int) -> float:  # priced + margin_ms(tokens, priced)
            t = memo.get(tokens)
            if t is None:
                t = priced(tokens)
                if margin:
                    t += low if tokens <= budget else share * t
                memo[tokens] = t
            return t
        return planned

    def fits(self, tokens: int, time_ms: float, spec_steps: int = 0, kv: int = 0, margin: bool = True) -> bool:
        """Whether an iteration whose pass holds `tokens` tokens is planned within `time_ms`."""
        return self.planned_ms(tokens, spec_steps, kv, margin) <= time_ms + 1e-9

    def time2bs(self, time_ms: float, spec_steps: int = 0, kv: int = 0, margin: bool = True) -> int:
        """The most tokens one pass may hold for its iteration to be planned within `time_ms` (0: not one)."""
        return most_tokens(self.pricer(spec_steps, kv, margin), time_ms)

    # ---- fitting -------------------------------------------------------------------------------------
    def observe_record(self, record: IterationRecord, replica: int, kv: int = 0) -> None:
        s = sample_of(record, replica, kv)
        if s is not None:
            self.observe(s)

    def observe(self, s: PassSample) -> None:
        """Price the iteration as it was, keep the error, then refit from it."""
        a = self.smoothing
        if s.tokens > 0 and s.total_ms > 0:
            predicted = self.iteration_ms(s.tokens, s.depth, s.spec, s.width, s.lag, s.kv)
            self._keep_residual(s.prompt > 0, s.total_ms - predicted, predicted)
            self.errors.append(abs(s.total_ms - predicted) / s.total_ms)
        if s.decoded and s.total_ms > 0:
            self.t_spec_ms += a * (s.total_ms - self.t_spec_ms)
        if s.tokens > 0 and s.service_ms > 0:
            self._observe_target(s.tokens, float(s.kv), s.service_ms, s.prompt > 0)
            self.r_t = _ema(self.r_t, max(0.0, s.call_ms - s.service_ms), a)
        drafted = s.spec > 0 and s.depth > 0 and s.draft_service_ms > 0
        if drafted:
            self.gateway_drafted = _ema(self.gateway_drafted, s.schedule_ms, a)
        else:
            self.gateway = _ema(self.gateway, s.schedule_ms, a)
        if drafted:
            self.draft.observe([1.0, float(s.depth), float(s.depth * s.spec * s.width), float(s.lag)],
                               s.draft_service_ms)
            self.r_d = _ema(self.r_d, max(0.0, s.draft_call_ms - s.draft_service_ms), a)
            self.spec = _ema(self.spec, float(s.spec), a)
            self.lag = _ema(self.lag, float(s.lag), a)

    def _observe_target(self, tokens: int, kv: float, ms: float, prompt: bool = False) -> None:
        a = self.smoothing
        if tokens >= (self._keys[0] if self._keys else ANCHOR_TOKENS):  # below the table the line is no reference
            ms = min(ms, OUTLIER_FACTOR * self.target_ms(tokens, int(kv)))  # one stalled pass cannot set a count's time
        self.line.observe([1.0, float(tokens)], ms)
        old = self.seen.get(tokens)
        if old is None:
            self.seen[tokens] = (ms, kv)
            bisect.insort(self._keys, tokens)
        else:
            d_kv, d_ms = kv - old[1], ms - old[0]
            if not prompt:
                decay = self.line.decay
                self.kv_slope = [self.kv_slope[0] * decay + d_kv * d_ms, self.kv_slope[1] * decay + d_kv * d_kv]
            self.seen[tokens] = (old[0] + a * d_ms, old[1] + a * d_kv)
        self.kv_min = int(kv) if len(self.seen) == 1 and old is None else min(self.kv_min, int(kv))
        self.kv_max = max(self.kv_max, int(kv))

    # ---- the report ------------------------------------------------------------------------------------
    def error_summary(self) -> dict[str, float | int]:
        """The out-of-sample relative error of the recent iterations: count, median and p90 of |T - T̂| / T."""
        e = list(self.errors)
        if not e:
            return {"iterations": 0}
        return {"iterations": len(e), "median": float(np.median(e)), "p90": float(np.quantile(e, 0.9))}


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """np.interp(x, xs, ys) for one x within [xs[0], xs[-1]] (or left of it), with NumPy's arithmetic, so the
    same float: a call on a scalar costs NumPy microseconds that the planner's searches pay thousands of times."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    j = bisect.bisect_right(xs, x) - 1  # xs[j] <= x < xs[j + 1]
    if x == xs[j]:
        return ys[j]
    slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
    return slope * (x - xs[j]) + ys[j]


def _line(curve: list[tuple[int, float]], baseline_ms: float) -> tuple[float, float]:
    """c0 + c1 * tokens through the profiled curve (least squares); flat at the baseline without one."""
    if len(curve) < 2:
        return baseline_ms, 0.0
    x = np.array([t for t, _ in curve], dtype=np.float64)
    y = np.array([ms for _, ms in curve], dtype=np.float64)
    c1 = max(0.0, float(np.polyfit(x, y, 1)[0])) if np.ptp(x) > 0 else 0.0
    return max(0.0, float(y.mean() - c1 * x.mean())), c1


__all__ = ["OnlineLinear", "PassCost", "PassSample", "most_tokens", "sample_of"]
