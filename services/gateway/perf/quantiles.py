"""SortedWindow: the values of a sliding window kept sorted, and their quantiles as numpy computes them.

The cost model's margin needs three quantiles of its last passes' residuals at every plan; kept
sorted as passes come and go (one insort and at most one removal a pass), each quantile is an index
and one interpolation instead of a sort of the whole window. `quantile` is numpy's default ("linear",
Hyndman and Fan's 7th method) step for step, so it returns the very float `np.quantile` would.
"""

from __future__ import annotations

import bisect
import math


class SortedWindow:
    """A multiset of floats, sorted; the caller adds and removes values as its window moves."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def __len__(self) -> int:
        return len(self.values)

    def add(self, value: float) -> None:
        bisect.insort(self.values, value)

    def remove(self, value: float) -> None:
        del self.values[bisect.bisect_left(self.values, value)]

    def quantile(self, q: float) -> float:
        """`float(np.quantile(values, q))` for a non-empty window (no NaN in it)."""
        v, n = self.values, len(self.values)
        virtual = (n - 1) * q
        if virtual >= n - 1:
            return v[-1]
        if virtual < 0:
            return v[0]
        below = math.floor(virtual)
        a, b = v[below], v[below + 1]
        gamma = virtual - below
        diff = b - a
        return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma
