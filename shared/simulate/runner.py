"""SimulatedRunner: the ModelRunner with the model pass replaced by the latency model.

Everything but the pass is the real runner's: the block manager and its KV accounting, the checks
on entries, pending trees and forests, commit and discard. The pass takes the modelled time (the
runner sleeps for what its own bookkeeping has not used; no CPU is burned) and returns, instead of
logits, per requested row the true next token (text.TruthText) for the target, or nothing (an
empty row) for the draft, whose candidates come from the acceptance model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from specserve.shared.runtime.batch import DraftNodes, Entry, Tree, entry_logits_at
from specserve.shared.runtime.block_manager import BlockManager
from specserve.shared.runtime.runner import ModelRunner, RunModel
from specserve.shared.simulate.latency import LatencyModel
from specserve.shared.simulate.text import TruthText
from specserve.shared.spec.token_tree import depths


class SimulatedRunner(ModelRunner):
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int, latency: LatencyModel,
                 truth: TruthText | None = None, sleep: Callable[[float], None] = time.sleep):
        # No model and no KV tensors: ModelRunner.__init__ is not called.
        self.blocks = BlockManager(num_blocks, block_size)
        self.vocab_size = vocab_size
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.inputs_for = "simulated"  # (no pass of its own: `decode` goes through `forward`, hence `_compute`)
        self._pending = {}
        self.latency, self.truth, self.sleep = latency, truth, sleep
        self.history: dict[str, list[int]] = {}  # the tokens whose (simulated) KV is committed
        self._pending_tokens: dict[str, list[int]] = {}
        self.modelled_ms = 0.0  # sum over passes, for stats and benches
        self.model_ms = 0.0  # the last pass's modelled time
        self.last_logits = None  # (its rows are not one tensor's)

    def _compute(self, entries: Sequence[Entry], starts: list[int], prior_parents: dict[int, list[int]],
                 run_model: RunModel | None) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        outputs = [self._rows(entry, start) for entry, start in zip(entries, starts)]  # (`forward` keeps the tokens)
        ms = self.latency.pass_ms([(len(e.tokens), s) for e, s in zip(entries, starts)])
        self.modelled_ms += ms
        self.model_ms = ms
        left = ms / 1e3 - (time.perf_counter() - t0)
        if left > 0:
            self.sleep(left)
        return outputs

    def _rows(self, entry: Entry, start: int) -> torch.Tensor:
        rows = entry_logits_at(entry)
        if self.truth is None or isinstance(entry, DraftNodes):
            return torch.zeros(len(rows), 0)
        history = self.history.get(entry.request_id, [])
        before = history[-1] if history else -1
        toks = entry.tokens
        if isinstance(entry, Tree):
            level = depths(entry.parents)
            prev2 = [before if entry.parents[i] < 0 else toks[entry.parents[i]] for i in rows]
            pos = [start + level[i] + 1 for i in rows]
        else:
            prev2 = [before if i == 0 else toks[i - 1] for i in rows]
            pos = [start + i + 1 for i in rows]
        out = [self.truth.next_token(p2, toks[i], p) for i, p2, p in zip(rows, prev2, pos)]
        return torch.tensor(out, dtype=torch.int64)

    def _move_kv(self, src: list[int], dst: list[int]) -> None:
        pass  # there are no KV rows to move
