"""FeatureLog: a request's target features by position, kept for a draft that reads them (EAGLE).

The target returns the features of every prefill chunk token and of each verified tree's accepted
path; they are written at their positions (a preempted request's re-prefill writes the same rows
again) and read from the position the draft holds up to, on the request's next draft call.
"""

from __future__ import annotations

import torch


class FeatureLog:
    def __init__(self) -> None:
        self._rows: torch.Tensor | None = None  # [capacity, hidden] float32
        self.known = 0  # leading positions written

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Rows for positions start .. start + len - 1; a gap past the known positions drops them."""
        if start > self.known or not len(rows):
            return
        end = start + len(rows)
        if self._rows is None or end > len(self._rows):
            grown = torch.empty(max(end, 2 * (0 if self._rows is None else len(self._rows)), 64), rows.shape[1])
            if self._rows is not None:
                grown[:self.known] = self._rows[:self.known]
            self._rows = grown
        self._rows[start:end] = rows
        self.known = max(self.known, end)

    def read(self, start: int) -> torch.Tensor:
        """The rows from `start` to the newest known position (a copy)."""
        if self._rows is None or start >= self.known:
            return torch.empty(0, 0 if self._rows is None else self._rows.shape[1])
        return self._rows[start:self.known].clone()
