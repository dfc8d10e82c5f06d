"""SLO classes: what `service_tier` names, and how an explicit `slo` object overrides it.

The defaults follow AdaServe's three categories (Table 2), scaled to this machine: the paper's
7B figures are 1.0x, 2.4x (30 ms) and 8x (100 ms) the baseline iteration latency of 12.5 ms, so
the classes here are those multiples of the profiled baseline. OpenAI's own tier names are
aliases. TTFT targets are not part of AdaServe; the defaults are generous fixed values that
only the metrics (and later admission control) use.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CLASS = "chat"
ALIASES = {"priority": "critical", "default": "chat", "auto": "chat", "flex": "chat", "scale": "chat"}


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    tpot_ms: float  # target mean time per output token after the first, ms
    ttft_ms: float  # target time to first token, ms


def default_classes(baseline_ms: float) -> dict[str, SloClass]:
    return {
        "critical": SloClass("critical", round(baseline_ms * 1.0, 3), 1000.0),  # code completion, agents
        "search": SloClass("search", round(baseline_ms * 2.4, 3), 2000.0),
        "chat": SloClass("chat", round(baseline_ms * 8.0, 3), 5000.0),  # a reader's pace
    }


def parse_class(spec: str) -> SloClass:
    """NAME=TPOT_MS[:TTFT_MS], e.g. 'gold=15:500' (the --slo-class flag)."""
    name, _, value = spec.partition("=")
    tpot, _, ttft = value.partition(":")
    try:
        cls = SloClass(name.strip(), float(tpot), float(ttft) if ttft else 5000.0)
    except ValueError:
        raise ValueError(f"bad SLO class {spec!r}: expected NAME=TPOT_MS[:TTFT_MS]") from None
    if not cls.name or cls.tpot_ms <= 0 or cls.ttft_ms <= 0:
        raise ValueError(f"bad SLO class {spec!r}: a name and positive milliseconds are needed")
    return cls


def resolve(classes: dict[str, SloClass], tier: str | None, tpot_ms: float | None,
            ttft_ms: float | None) -> SloClass | None:
    """The request's SLO: its tier's class (None if the name is unknown), with explicit values on top."""
    name = ALIASES.get(tier, tier) if tier is not None else DEFAULT_CLASS
    base = classes.get(name)
    if base is None:
        return None
    if tpot_ms is None and ttft_ms is None:
        return base
    return SloClass(base.name if tier is not None else "custom", tpot_ms or base.tpot_ms, ttft_ms or base.ttft_ms)
