"""Beam steps 2..d at static shapes, replayed as CUDA graphs keyed by (bucketed n, w, KV bucket).

Every later beam step runs the same shape: n requests x w nodes. The runner builds the pass's
inputs as usual; `StaticBeamStep.run_model` pads them to a bucket (requests to the next power of
two, KV blocks per request to the next power of two) so that each (n bucket, w, KV bucket) has one
fixed set of input tensors, and on CUDA replays a graph captured for it. Padding rows write their
KV to one reserved scratch block and attend only to key 0; padded KV columns are masked out, so
the real rows see exactly what the unpadded pass sees.

On CPU the service stays eager and does not use this module; the tests run its padding eagerly
(use_graphs=False) to check that a padded pass returns the unpadded pass's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.shared.runtime.attention import AttentionGroup, AttentionMetadata
from specserve.shared.runtime.batch import SMALL_QUERY, DraftNodes, ModelInputs
from specserve.shared.runtime.kv_cache import KVCache
from specserve.shared.runtime.model import CausalLM
from specserve.shared.runtime.runner import ModelRunner

PAD_REQUEST = "__static_step_pad__"


def bucket(n: int) -> int:
    """The next power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(slots=True)
class _Static:
    """The fixed tensors of one bucket: inputs are copied in, the output is read after replay."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_dest: torch.Tensor
    logits_indices: torch.Tensor
    masks: dict[int | None, torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None

    def meta(self, batch: int, width: int) -> AttentionMetadata:
        group = AttentionGroup(None, self.block_table, self.query_dest, batch, width, self.masks)
        return AttentionMetadata(self.slot_mapping, [group])


class StaticBeamStep:
    def __init__(self, runner: ModelRunner, use_graphs: bool):
        self.runner = runner
        self.use_graphs = use_graphs and runner.device.type == "cuda"
        bs = runner.blocks.block_size
        runner.blocks.append_slots({PAD_REQUEST: bs})  # one scratch block for the padding rows' KV
        self.pad_block = runner.blocks.block_table(PAD_REQUEST)[0]
        self.pad_slot = self.pad_block * bs
        self.statics: dict[tuple[int, int, int], _Static] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.captures = 0  # graphs captured so far (a call that captured says so: SpeculateReply.warmup)

    def applies(self, entries: list[DraftNodes]) -> bool:
        """One width for all entries, and logits for every node (the beam step's shape)."""
        widths = {len(e.tokens) for e in entries}
        return len(widths) == 1 and next(iter(widths)) <= SMALL_QUERY and all(e.logits_at is None for e in entries)

    def forward(self, entries: list[DraftNodes]) -> list[torch.Tensor]:
        return self.runner.forward(entries, run_model=self.run_model)

    def run_model(self, model: CausalLM, kv: KVCache, inputs: ModelInputs) -> torch.Tensor:
        (group,) = inputs.attention.groups
        n, w = group.batch_size, group.max_q
        n_b, blocks_b = bucket(n), bucket(group.block_table.shape[1])
        key = (n_b, w, blocks_b)
        static = self.statics.get(key)
        fresh = static is None
        if static is None:
            static = self.statics[key] = self._allocate(n_b, w, blocks_b, inputs)
        self._fill(static, inputs, n * w)
        if not self.use_graphs:
            out: torch.Tensor = model(static.input_ids, static.positions, kv, static.meta(n_b, w),
                                      static.logits_indices)
            return out[: n * w]
        if fresh:
            self._capture(static, model, kv, n_b, w)
        assert static.graph is not None and static.output is not None  # _capture set both on the first call
        static.graph.replay()
        return static.output[: n * w].clone()

    def _allocate(self, n_b: int, w: int, blocks_b: int, inputs: ModelInputs) -> _Static:
        device = inputs.input_ids.device
        rows = n_b * w
        kv_len = blocks_b * self.runner.blocks.block_size
        i64 = torch.int64
        return _Static(
            input_ids=torch.zeros(rows, dtype=i64, device=device),
            positions=torch.zeros(rows, dtype=i64, device=device),
            slot_mapping=torch.full((rows,), self.pad_slot, dtype=i64, device=device),
            block_table=torch.full((n_b, blocks_b), self.pad_block, dtype=i64, device=device),
            query_dest=torch.arange(rows, dtype=i64, device=device),
            logits_indices=torch.arange(rows, dtype=i64, device=device),
            masks={window: torch.zeros(n_b, 1, w, kv_len, dtype=torch.bool, device=device)
                   for window in inputs.attention.groups[0].masks},
        )

    def _fill(self, static: _Static, inputs: ModelInputs, real: int) -> None:
        """Copy the `real` rows in and reset the padding (the tensors are reused across calls)."""
        (group,) = inputs.attention.groups
        n = group.batch_size
        static.input_ids.zero_()[:real].copy_(inputs.input_ids)
        static.positions.zero_()[:real].copy_(inputs.positions)
        static.slot_mapping.fill_(self.pad_slot)[:real].copy_(inputs.attention.slot_mapping)
        static.block_table.fill_(self.pad_block)[:n, : group.block_table.shape[1]].copy_(group.block_table)
        kv_len = group.block_table.shape[1] * self.runner.blocks.block_size
        for window, mask in static.masks.items():
            mask.zero_()
            mask[:n, :, :, :kv_len].copy_(group.masks[window])
            mask[n:, :, :, 0] = True  # padding rows attend to key 0 only, so softmax stays finite

    def _capture(self, static: _Static, model: CausalLM, kv: KVCache, n_b: int, w: int) -> None:
        meta = static.meta(n_b, w)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, kernels' lazy init)
                model(static.input_ids, static.positions, kv, meta, static.logits_indices)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static.output = model(static.input_ids, static.positions, kv, meta, static.logits_indices)
        static.graph = graph
        self.captures += 1
