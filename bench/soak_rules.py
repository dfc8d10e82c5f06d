"""The soak's rules, as pure functions of what it recorded (no I/O: tests/unit/test_soak_rules.py).

1. `lost`: no request is lost that a fault did not own. A request either completes, or is refused at
   admission (503 with Retry-After: counted apart, not lost), or is owned by a fault: a killed target
   replica owns the requests it was serving when it died (in flight then, ended with the gateway's
   "the target service failed" error; that happens only when no other replica is up, else they move
   and complete), a killed front end the streams it served (in flight then, its
   pid in their `X-Specserve-Frontend` header, or no response at all for a connection it had accepted
   but not yet answered). Everything else that fails is lost.
2. `rss`: after the warm-up, no process's anonymous RSS (what a leak grows; the file-backed pages of
   its mapped weights and libraries come and go with the page cache) grows by more than
   `rss_mb_per_10min` per 10 minutes:
   the Theil-Sen slope (the median of the slopes between every pair of samples: robust to the odd
   spike, and to a single step such as an allocator reaching a new high-water mark at a peak of
   load) of each process incarnation's samples after the warm-up (for a process restarted by a
   fault, after the warm-up's length from its start, when the run leaves at least that long after).
3. `idle`: after each fault and at the end, once nothing runs, every process's descriptors, threads
   and event-loop tasks are back to their idle values and no model service holds a KV block or a
   request (`idle_differences`; the soak polls it up to a grace period). A process's idle values are
   those of the first checkpoint after the warm-up; a process restarted by a fault gets its own at its
   second checkpoint (its first comes right after its start, before it served anything).
4. `tpot`: the TPOT p99 of the last stretch of clean load (`span_s` of clean windows) is at most
   (1 + tolerance) x that of the first stretch (a clean window is one wholly under the steady load,
   after the warm-up, touching no fault or checkpoint).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from specserve.cli.loadgen.records import RequestRecord, percentile

TARGET_FAILED = "the target service failed"
TRANSPORT_ERRORS = ("ServerDisconnectedError", "ClientOSError", "ClientPayloadError", "ClientConnectorError",
                    "ConnectionResetError")
IDLE_FIELDS = ("fds", "threads", "tasks")


def refused(r: RequestRecord) -> bool:
    return r.status == 503 and r.retry_after_s is not None


def owner(r: RequestRecord, end_s: float, frontend: int | None, faults: Sequence[dict[str, Any]]) -> str | None:
    """The fault that owns a failed request (module docstring, rule 1), or None."""
    for f in faults:
        in_flight = r.sent_s <= f["t"] <= end_s
        if f["kind"] == "kill-target" and in_flight and TARGET_FAILED in (r.error or ""):
            return f["name"]
        if f["kind"] == "kill-frontend" and in_flight and frontend == f["pid"]:
            return f["name"]
        if (f["kind"] == "kill-frontend" and frontend is None and r.status == 0 and r.sent_s <= f["t"] + 0.5
                and end_s >= f["t"] and (r.error or "").split(":")[0] in TRANSPORT_ERRORS):
            return f["name"]  # accepted by the front end that died, never answered
    return None


def account(sent: Iterable[Any], faults: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts of completed, refused, fault-owned and lost requests; the lost and owned ones listed.
    `sent`: the soak's Sent rows (record, source, frontend, end_s)."""
    out: dict[str, Any] = {"requests": 0, "completed": 0, "refused": 0, "owned": {}, "lost": []}
    for s in sent:
        r = s.record
        out["requests"] += 1
        if r.ok:
            out["completed"] += 1
        elif refused(r):
            out["refused"] += 1
        elif (name := owner(r, s.end_s, s.frontend, faults)) is not None:
            out["owned"][name] = out["owned"].get(name, 0) + 1
        else:
            out["lost"].append({"index": r.index, "source": s.source, "sent_s": round(r.sent_s, 3),
                                "status": r.status, "error": r.error, "frontend": s.frontend})
    return out


def theil_sen(points: Sequence[tuple[float, float]]) -> float | None:
    """The median of the pairwise slopes (dy/dx); None with fewer than 2 distinct x."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1]
    return statistics.median(slopes) if slopes else None


def rss_growth(samples: Sequence[dict[str, Any]], warmup_end_s: float, warmup_s: float,
               min_points: int = 4, field: str = "anon_mb") -> list[dict[str, Any]]:
    """Per process incarnation (role, pid): the slope of its `field` (MB: anonymous RSS, or RSS) after the
    warm-up (which ends at `warmup_end_s`; for a process that started later, `warmup_s` after its first
    sample), MB per 10 minutes; None where
    its samples after that span less than `warmup_s` or number fewer than `min_points` (too short to
    judge: a per-10-minutes slope of a few minutes is mostly noise)."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    first: dict[tuple[str, int], float] = {}
    for snap in samples:
        for role, p in snap["procs"].items():
            key = (role, p["pid"])
            first.setdefault(key, snap["t"])
            series.setdefault(key, []).append((snap["t"], p[field]))
    out = []
    for (role, pid), points in series.items():
        start = warmup_end_s if first[(role, pid)] <= samples[0]["t"] else first[(role, pid)] + warmup_s
        used = [(t, mb) for t, mb in points if t >= start]
        judged = len(used) >= min_points and used[-1][0] - used[0][0] >= warmup_s
        slope = theil_sen(used) if judged else None
        out.append({"role": role, "pid": pid, "from_s": start, "points": len(used),
                    "first_mb": used[0][1] if used else None, "last_mb": used[-1][1] if used else None,
                    "mb_per_10min": None if slope is None else slope * 600})
    return out


def idle_differences(baseline: dict[str, Any], snap: dict[str, Any]) -> list[str]:
    """What keeps `snap` from being idle: anything running or held (gateway, model services), and every
    process whose descriptors, threads or tasks differ from its baseline (a process with another pid
    than its baseline's is not compared: it is a new incarnation)."""
    out = []
    health = snap.get("health") or {}
    for key in ("running", "waiting"):
        if health.get(key):
            out.append(f"gateway {key} {health[key]}")
    for name, kv in snap["kv"].items():
        if kv.get("used") or kv.get("requests"):
            out.append(f"{name} holds {kv.get('used'):g} KV blocks, {kv.get('requests'):g} requests")
    for role, b in baseline.items():
        s = snap["procs"].get(role)
        if s is None:
            out.append(f"{role}: no process")
        elif s["pid"] == b["pid"]:
            out += [f"{role} {f} {b[f]:g} -> {s.get(f)}" for f in IDLE_FIELDS
                    if b.get(f) is not None and s.get(f) != b[f]]
    return out


def update_baseline(baseline: dict[str, Any], seen: dict[str, int], snap: dict[str, Any]) -> list[str]:
    """After an idle checkpoint: a process not in `baseline` (or with a new pid) is recorded as seen at
    this checkpoint, and its values become its baseline at its next one. Returns the roles given a
    baseline now. `seen`: role -> the pid seen at the previous checkpoint."""
    set_now, first = [], not baseline
    for role, s in snap["procs"].items():
        if role in baseline and baseline[role]["pid"] == s["pid"]:
            continue
        if seen.get(role) == s["pid"] or first:  # its second checkpoint (or the very first one)
            baseline[role] = {k: s.get(k) for k in ("pid", *IDLE_FIELDS)}
            set_now.append(role)
        seen[role] = s["pid"]
    return set_now


def windows(samples: Sequence[dict[str, Any]], done: Sequence[tuple[float, RequestRecord]],
            disturbed: Sequence[tuple[float, float]], steady_from: float) -> list[dict[str, Any]]:
    """Latency per window between consecutive samples, from the client's records that ended in it:
    TTFT and TPOT p50 / p99 (ms). `clean`: after `steady_from`, and overlapping no disturbed span
    (a fault until its checkpoint ended)."""
    out = []
    for a, b in zip(samples, samples[1:]):
        lo, hi = a["t"], b["t"]
        rs = [r for t, r in done if lo < t <= hi and r.ok]
        ttft = [r.ttft_ms for r in rs if r.ttft_ms is not None]
        tpot = [r.tpot_ms for r in rs if r.tpot_ms is not None]
        clean = lo >= steady_from and not any(s < hi and e > lo for s, e in disturbed)
        out.append({"from_s": lo, "to_s": hi, "requests": len(rs), "clean": clean,
                    "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                    "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99)})
    return out


def _group(wins: Sequence[dict[str, Any]], span_s: float) -> list[dict[str, Any]]:
    """The first windows of `wins` that together last at least span_s."""
    out, total = [], 0.0
    for w in wins:
        if total >= span_s:
            break
        out.append(w)
        total += w["to_s"] - w["from_s"]
    return out


def tpot_rule(wins: Sequence[dict[str, Any]], tpots: Sequence[tuple[float, float]], tolerance: float,
              span_s: float, min_requests: int = 10) -> dict[str, Any]:
    """Rule 4: TPOT p99 of the requests that ended in the last `span_s` of clean windows against the
    first `span_s` (each half the clean time when there is less than twice span_s of it). `tpots`:
    (end time, TPOT ms) of every completed request of the load."""
    clean = [w for w in wins if w["clean"]]
    span_s = min(span_s, sum(w["to_s"] - w["from_s"] for w in clean) / 2)
    groups = {"first": _group(clean, span_s), "last": _group(clean[::-1], span_s)[::-1]}
    out: dict[str, Any] = {"tolerance": tolerance, "span_s": span_s}
    for name, group in groups.items():
        values = [v for t, v in tpots if any(w["from_s"] < t <= w["to_s"] for w in group)]
        out[name] = {"from_s": group[0]["from_s"] if group else None, "to_s": group[-1]["to_s"] if group else None,
                     "requests": len(values), "tpot_p99_ms": percentile(values, 99)}
    if min(out["first"]["requests"], out["last"]["requests"]) < min_requests:
        return out | {"ok": False, "why": f"fewer than {min_requests} requests in the first or the last "
                                         f"{span_s:.0f} s of clean load: nothing to compare"}
    out["ratio"] = out["last"]["tpot_p99_ms"] / out["first"]["tpot_p99_ms"]
    return out | {"ok": out["ratio"] <= 1 + tolerance}


__all__ = ["account", "idle_differences", "owner", "rss_growth", "theil_sen", "tpot_rule", "update_baseline",
           "windows"]
