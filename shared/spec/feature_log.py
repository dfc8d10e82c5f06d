"""FeatureLog: one request's target features by position, for a draft that reads them (EAGLE).

The gateway keeps one per request: the target returns the features of every prefill chunk token and
of each verified tree's accepted path, written at their positions (a preempted request's re-prefill
writes the same rows again), and the rows the draft lacks go with the request's next draft call. The
EAGLE draft keeps one per request too, written from each call's `feature_start`.
"""

from __future__ import annotations

import torch


class FeatureLog:
    def __init__(self) -> None:
        self._rows: torch.Tensor | None = None  # [capacity, hidden] float32
        self.known = 0  # leading positions written

    def write(self, start: int, rows: torch.Tensor) -> bool:
        """Rows for positions start .. start + len - 1; False, writing nothing, for a gap past the known
        positions."""
        if start > self.known:
            return False
        if not len(rows):
            return True
        end = start + len(rows)
        if self._rows is None or end > len(self._rows):
            grown = torch.empty(max(end, 2 * (0 if self._rows is None else len(self._rows)), 64), rows.shape[1])
            if self._rows is not None:
                grown[:self.known] = self._rows[:self.known]
            self._rows = grown
        self._rows[start:end] = rows
        self.known = max(self.known, end)
        return True

    def read(self, start: int, end: int | None = None) -> torch.Tensor:
        """The rows of positions start .. end - 1 (to the newest known position by default), a copy."""
        end = self.known if end is None else min(end, self.known)
        if self._rows is None or start >= end:
            return torch.empty(0, 0 if self._rows is None else self._rows.shape[1])
        return self._rows[start:end].clone()
