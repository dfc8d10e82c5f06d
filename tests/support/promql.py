"""The metric names a PromQL expression reads."""

from __future__ import annotations

import re

PROMQL_WORDS = {"histogram_quantile", "rate", "irate", "increase", "sum", "avg", "min", "max", "count", "by",
                "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
                "abs", "clamp_min", "clamp_max", "delta", "deriv", "topk", "bottomk", "avg_over_time",
                "max_over_time", "min_over_time", "sum_over_time", "time", "vector", "scalar", "humanizePercentage"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers outside label matchers, grouping
    clauses, range selectors and strings, that are not PromQL's own words."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {n for n in names if n not in PROMQL_WORDS}
