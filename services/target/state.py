"""A request's state in the target service between calls, and the sampling parameters it decodes with.

The state a decode step reads and writes (committed count, newest token, last step, whether it is a plain
request) lives in `RequestRows`, the persistent batch: one row per request, one array per field, so that the
call's plain decodes are checked and committed by array operations (engine.py). `TargetRequest` keeps the
rest (sampling, history, logprobs) and reads its row's fields as attributes, for the code that works entry by
entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specserve.shared.spec.penalties import TokenHistory
from specserve.shared.spec.sampling import SamplingParams
from specserve.shared.wire.messages import SamplingSpec
from specserve.target.logprobs import LogprobState


def params_of(spec: SamplingSpec) -> SamplingParams:
    """A request's sampling parameters (ValueError for values the sampler does not take)."""
    stops = tuple(dict.fromkeys([*spec.stop_token_ids, *spec.eos_ids])) if spec.min_tokens > 0 else ()
    return SamplingParams(spec.temperature, spec.top_p, spec.top_k, spec.seed, spec.min_p, spec.repetition_penalty,
                          spec.presence_penalty, spec.frequency_penalty, spec.min_tokens, stops)


class RequestRows:
    """The persistent batch: every held request's decode state, a row each (`row_of`), as arrays that grow by
    doubling: `committed` (prompt + output tokens once decoding; the KV holds committed - 1), `last_token`
    (the newest committed token: the next tree's root), `last_step`, and `plain` (greedy, no history, no
    logprobs: its decodes skip the per-entry layers)."""

    def __init__(self, capacity: int = 64):
        self.row_of: dict[str, int] = {}
        self.committed = np.zeros(0, np.int64)
        self.last_token = np.zeros(0, np.int64)
        self.last_step = np.zeros(0, np.int64)
        self.plain = np.zeros(0, bool)
        self._free: list[int] = []
        self._grow(capacity)

    def add(self, rid: str, plain: bool) -> int:
        """A new request's row, its state reset (nothing committed, no token, no step)."""
        if not self._free:
            self._grow(2 * len(self.committed))
        row = self.row_of[rid] = self._free.pop()
        self.committed[row], self.last_token[row], self.last_step[row], self.plain[row] = 0, -1, -1, plain
        return row

    def remove(self, rid: str) -> None:
        row = self.row_of.pop(rid, None)
        if row is not None:
            self._free.append(row)

    def __len__(self) -> int:
        """Rows in use (held by a request, or lost by one that was not removed)."""
        return len(self.committed) - len(self._free)

    def rows(self, rids: Sequence[str]) -> np.ndarray:
        """The rows of `rids`, -1 for a request not held."""
        get = self.row_of.get
        return np.fromiter((get(rid, -1) for rid in rids), dtype=np.int64, count=len(rids))

    def _grow(self, capacity: int) -> None:
        old = len(self.committed)
        for name in ("committed", "last_token", "last_step", "plain"):
            array = getattr(self, name)
            grown = np.zeros(capacity, array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        self._free.extend(range(capacity - 1, old - 1, -1))


class TargetRequest:
    """A request's state in the target between calls: its sampling, and its row of `RequestRows`."""

    __slots__ = ("params", "generator", "prefilled", "history", "logprobs", "row", "_rows")

    def __init__(self, params: SamplingParams, generator: torch.Generator | None, rows: RequestRows, rid: str,
                 history: TokenHistory | None = None, logprobs: LogprobState | None = None, plain: bool = False):
        self.params, self.generator = params, generator
        self.prefilled = 0  # prompt tokens in the KV cache
        self.history = history  # with penalties or min_tokens: its tokens as they read them
        self.logprobs = logprobs  # only for a request that asked for logprobs
        self._rows, self.row = rows, rows.add(rid, plain)

    @property
    def committed(self) -> int:
        return int(self._rows.committed[self.row])

    @committed.setter
    def committed(self, value: int) -> None:
        self._rows.committed[self.row] = value

    @property
    def last_token(self) -> int:
        return int(self._rows.last_token[self.row])

    @last_token.setter
    def last_token(self, value: int) -> None:
        self._rows.last_token[self.row] = value

    @property
    def last_step(self) -> int:
        return int(self._rows.last_step[self.row])

    @last_step.setter
    def last_step(self, value: int) -> None:
        self._rows.last_step[self.row] = value

    @property
    def plain(self) -> bool:
        return bool(self._rows.plain[self.row])

    @property
    def decoding(self) -> bool:
        return self.committed > 0
