"""The soak's picture: RSS, KV and latency over the run, the faults marked (matplotlib, no display).

Three panels on one time axis (minutes from the start of the steady load):
1. each process's anonymous RSS minus its value at the end of the warm-up, MB (a leak is a line that keeps
   rising); a process restarted by a fault is dashed, from the end of its own warm-up on;
2. KV blocks held by the draft and every target replica, and the requests the gateway runs;
3. TTFT and TPOT p50 / p99 per window, from the client's own records (log scale).
A fault is a dashed vertical line with its name; an idle checkpoint (the load paused until nothing
runs and every count is back) is a shaded span.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["load_start_s"]

    def m(t: float) -> float:
        return (t - t0) / 60

    samples = [s for s in result["samples"] if s["t"] >= t0]
    fig, (rss, kv, lat) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in samples:
        for role, p in s["procs"].items():
            series.setdefault((role, p["pid"]), []).append((s["t"], p.get("anon_mb", p["rss_mb"])))
    judged_from = {(g["role"], g["pid"]): g["from_s"] for g in result["rules"]["rss"]["growth"]}
    colors: dict[str, Any] = {}
    for (role, pid), points in sorted(series.items()):
        start = judged_from.get((role, pid), t0)
        original = points[0][0] <= samples[0]["t"]
        shown = [(t, v) for t, v in points if t >= (t0 if original else start)]  # a restart from its warm-up on
        base = next((v for t, v in points if t >= start), None)
        if not shown or base is None:
            continue
        first = role not in colors
        color = colors.setdefault(role, f"C{len(colors) % 10}")
        rss.plot([m(t) for t, _ in shown], [v - base for _, v in shown], color=color, label=role if first else None,
                 linestyle="-" if original else "--")
    rss.set_ylabel("anonymous RSS - after warm-up, MB")
    rss.legend(fontsize=7, ncol=4, loc="lower left")
    names = sorted({n for s in samples for n in s["kv"]})
    for n in names:
        kv.plot([m(s["t"]) for s in samples if n in s["kv"]], [s["kv"][n].get("used") for s in samples if n in s["kv"]],
                label=f"{n} KV blocks used")
    kv.plot([m(s["t"]) for s in samples], [(s.get("health") or {}).get("running") for s in samples], "k:",
            label="gateway running")
    kv.set_ylabel("blocks / requests")
    kv.legend(fontsize=7, ncol=3, loc="upper left")
    wins = result["windows"]
    styles = (("ttft_p50_ms", "C0-"), ("ttft_p99_ms", "C0--"), ("tpot_p50_ms", "C1-"), ("tpot_p99_ms", "C1--"))
    for key, style in styles:
        lat.plot([m(w["to_s"]) for w in wins], [w[key] for w in wins], style, label=key.replace("_ms", ""))
    lat.set_yscale("log")
    lat.set_ylabel("ms (client)")
    lat.set_xlabel("minutes of steady load")
    lat.legend(fontsize=7, ncol=4, loc="upper left")
    for ax in (rss, kv, lat):
        for f in result["faults"]:
            ax.axvline(m(f["t"]), color="red", linestyle="--", linewidth=0.8)
        for c in result["checkpoints"]:
            ax.axvspan(m(c["start_s"]), m(c["end_s"]), color="grey", alpha=0.15)
    for f in result["faults"]:
        rss.annotate(f["name"], (m(f["t"]), 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                     va="top", ha="right", color="red")
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["plot"]
