"""Request arrival times: Poisson, gamma-bursty, or replayed from a trace.

Every function returns `n` send offsets in seconds from the start of the run, non-decreasing and
starting near 0. They follow `vllm bench serve`: gaps are gamma-distributed with shape
`burstiness` and mean 1/rate, so burstiness 1 is a Poisson process and smaller values are
burstier (the same mean rate, a larger variance of the gaps).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path


def gamma_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """`n` arrivals at `rate` requests/s with gamma gaps of shape `burstiness` (1.0 = Poisson).

    The first request is sent at 0; rate = inf sends everything at once."""
    if n < 0:
        raise ValueError("n must be >= 0")
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 (got {rate})")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (got {burstiness})")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)  # scale: the mean gap shape * theta is 1/rate
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    return gamma_arrivals(n, rate, 1.0, seed)


def _valid_segment(duration: float, rate: float) -> bool:
    """A schedule segment lasts a finite time > 0 at a finite rate >= 0."""
    return duration > 0 and math.isfinite(duration) and rate >= 0 and math.isfinite(rate)


def parse_rate_schedule(spec: str) -> list[tuple[float, float]]:
    """'20:0.5,10:1.5,30:0.5' -> [(20.0, 0.5), (10.0, 1.5), (30.0, 0.5)]: (seconds, requests/s) segments."""
    segments = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        dur, sep, rate = part.partition(":")
        try:
            if not sep:
                raise ValueError
            seg = (float(dur), float(rate))
        except ValueError:
            raise ValueError(f"bad rate segment {part!r}: expected SECONDS:RATE, e.g. 10:1.5") from None
        if not _valid_segment(*seg):
            raise ValueError(f"bad rate segment {part!r}: seconds must be > 0 and the rate >= 0, both finite")
        segments.append(seg)
    if not segments:
        raise ValueError(f"the rate schedule {spec!r} has no segment")
    return segments


def piecewise_arrivals(segments: list[tuple[float, float]], burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrivals of a piecewise-constant rate: segment k lasts `segments[k][0]` seconds at `segments[k][1]`
    requests/s (0: none), one after another from t = 0 (e.g. a burst: `[(20, r), (10, 3 r), (30, r)]`).

    Within a segment the gaps are gamma of shape `burstiness` at that segment's mean rate, starting from
    the segment's start; an arrival past its end is dropped and the next segment starts afresh (exact
    for Poisson, which is memoryless; for other shapes the gap that spans a boundary is redrawn). The
    number of requests follows from the schedule: about sum(duration x rate)."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (got {burstiness})")
    rng = random.Random(seed)
    out: list[float] = []
    start = 0.0
    for duration, rate in segments:
        if not _valid_segment(duration, rate):
            raise ValueError(f"bad segment ({duration}, {rate}): seconds must be > 0 and the rate >= 0, both finite")
        end = start + duration
        if rate > 0:
            theta = 1.0 / (rate * burstiness)
            t = start + rng.gammavariate(burstiness, theta)
            while t < end:
                out.append(t)
                t += rng.gammavariate(burstiness, theta)
        start = end
    return out


def load_trace(path: str | Path) -> list[float]:
    """Timestamps in seconds from a trace file: one number per line, or JSONL rows with a `timestamp`
    (or `arrival_time`, `time`) field. Blank lines and lines starting with # are skipped."""
    times = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if line.startswith("{"):
                row = json.loads(line)
                key = next((k for k in ("timestamp", "arrival_time", "time") if k in row), None)
                if key is None:
                    raise ValueError("no timestamp / arrival_time / time field")
                value = float(row[key])
            else:
                value = float(line.split(",")[0])
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: not a timestamp ({exc})") from None
        if not math.isfinite(value):
            raise ValueError(f"{path}:{lineno}: not a finite timestamp")
        times.append(value)
    if not times:
        raise ValueError(f"{path}: no timestamps")
    return times


def trace_arrivals(times: list[float], n: int | None = None, rate: float | None = None) -> list[float]:
    """Replay a trace: sorted, shifted to start at 0, cut to the first `n`, and, given `rate`, rescaled
    in time so that its mean rate is `rate` requests/s (as AdaServe rescales the SplitWise trace)."""
    ts = sorted(times)
    if n is not None:
        if n > len(ts):
            raise ValueError(f"the trace has {len(ts)} timestamps, fewer than the {n} requests asked for")
        ts = ts[:n]
    t0 = ts[0]
    ts = [t - t0 for t in ts]
    if rate is not None and len(ts) > 1 and ts[-1] > 0:
        if not rate > 0:
            raise ValueError(f"the request rate must be > 0 (got {rate})")
        scale = (len(ts) - 1) / rate / ts[-1]  # n-1 gaps over the span give the mean rate
        ts = [t * scale for t in ts]
    return ts
