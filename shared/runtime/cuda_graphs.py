"""The torch pass with Triton attention at bucketed static shapes, replayed as CUDA graphs (the target's decode
and verification passes, as the peers capture them).

A pass's inputs (`LeanInputs`: tokens, positions, the KeyLayout, the logits rows) are padded to a bucket:
tokens, entries, blocks per entry, tree-path slots and logits rows each to the next power of two. Each
bucket has one set of static device tensors; on CUDA a graph is captured for it on first use and replayed
after, with the inputs copied in. Padding tokens write their K/V into one reserved scratch block, read only
that slot, and their rows are dropped, so the real rows see exactly what the unpadded pass sees (the
attention kernel reads each token's keys by itself).

Passes larger than `max_tokens` run eagerly. Off CUDA nothing is captured: `use_graphs=False` runs the
padded pass eagerly, which is how the tests check the padding (through Triton's interpreter on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.shared.runtime.attention import KeyLayout
from specserve.shared.runtime.block_manager import BlockManager
from specserve.shared.runtime.kv_cache import KVCache
from specserve.shared.runtime.lean_inputs import LeanInputs
from specserve.shared.runtime.model import CausalLM

PAD_REQUEST = "__graph_pad__"
MAX_TOKENS = 256  # passes of more tokens (long prefill chunks) run eagerly


def bucket(n: int) -> int:
    """The next power of two >= n (1 for 0)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True, slots=True)
class BucketKey:
    tokens: int
    entries: int  # rows of the block table, the padding row included
    blocks: int  # blocks per table row
    extras: int  # tree-path slots
    logits: int  # logits rows


def bucket_key(inputs: LeanInputs) -> BucketKey:
    keys = inputs.keys
    return BucketKey(tokens=bucket(inputs.input_ids.numel()), entries=bucket(keys.tables.shape[0] + 1),
                     blocks=bucket(keys.tables.shape[1]), extras=bucket(keys.extra_slots.numel()),
                     logits=bucket(inputs.logits_indices.numel()))


@dataclass(slots=True)
class _Static:
    """One bucket's fixed tensors: inputs are copied in before each replay, the output read after."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    keys: KeyLayout
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None


class GraphedPasses:
    """`run(inputs)` -> the logits rows of `inputs.logits_indices`, through a bucket's graph (or eagerly)."""

    def __init__(self, model: CausalLM, kv: KVCache, blocks: BlockManager, device: torch.device, use_graphs: bool,
                 max_tokens: int = MAX_TOKENS):
        """model, kv, blocks: a ModelRunner's (one scratch block is taken from `blocks` for good)."""
        self.model, self.kv, self.device = model, kv, device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.max_tokens = max_tokens
        self.block_size = blocks.block_size
        blocks.append_slots({PAD_REQUEST: blocks.block_size})
        self.pad_block = blocks.block_table(PAD_REQUEST)[0]
        self.statics: dict[BucketKey, _Static] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.replays = self.captures = 0

    def fits(self, inputs: LeanInputs) -> bool:
        return inputs.input_ids.numel() <= self.max_tokens

    def run(self, inputs: LeanInputs) -> torch.Tensor:
        key = bucket_key(inputs)
        static = self.statics.get(key)
        fresh = static is None
        if static is None:
            static = self.statics[key] = self._allocate(key)
        self._fill(static, inputs)
        n = inputs.logits_indices.numel()
        if not self.use_graphs:
            return self._forward(static)[:n]
        if fresh:
            self._capture(static)
        assert static.graph is not None and static.output is not None
        static.graph.replay()
        self.replays += 1
        return static.output[:n].clone()

    # ---- internals --------------------------------------------------------------------------
    def _forward(self, static: _Static) -> torch.Tensor:
        logits: torch.Tensor = self.model(static.input_ids, static.positions, self.kv, static.keys,
                                          static.logits_indices)
        return logits

    def _allocate(self, key: BucketKey) -> _Static:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=self.device)

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=self.device)

        return _Static(
            input_ids=longs(key.tokens),
            positions=longs(key.tokens),
            logits_indices=longs(key.logits),
            keys=KeyLayout(
                slot_mapping=longs(key.tokens),
                tables=ints(key.entries, key.blocks),
                seq=ints(key.tokens),
                prefix=ints(key.tokens),
                extra_off=ints(key.tokens + 1),
                extra_slots=ints(key.extras),
                block_size=self.block_size,
            ),
        )

    def _fill(self, static: _Static, inputs: LeanInputs) -> None:
        """The real rows first; padding tokens write and read only the scratch block's first slot."""
        keys = inputs.keys
        t, b, mb = inputs.input_ids.numel(), keys.tables.shape[0], keys.tables.shape[1]
        e, n = keys.extra_slots.numel(), inputs.logits_indices.numel()
        pad_slot, s = self.pad_block * self.block_size, static
        s.input_ids.zero_()[:t].copy_(inputs.input_ids, non_blocking=True)
        s.positions.zero_()[:t].copy_(inputs.positions, non_blocking=True)
        s.logits_indices.zero_()[:n].copy_(inputs.logits_indices, non_blocking=True)
        k = s.keys
        k.slot_mapping.fill_(pad_slot)[:t].copy_(keys.slot_mapping, non_blocking=True)
        k.tables.fill_(self.pad_block)[:b, :mb].copy_(keys.tables, non_blocking=True)
        k.seq.fill_(b)[:t].copy_(keys.seq, non_blocking=True)  # row b: the padding row (all scratch)
        k.prefix.fill_(1)[:t].copy_(keys.prefix, non_blocking=True)
        k.extra_off.fill_(e)[: t + 1].copy_(keys.extra_off, non_blocking=True)
        k.extra_slots.zero_()[:e].copy_(keys.extra_slots, non_blocking=True)

    def _capture(self, static: _Static) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph: the allocator, Triton's compilation
                self._forward(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static.output = self._forward(static)
        static.graph = graph
        self.captures += 1
