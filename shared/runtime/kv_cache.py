"""The paged KV pool tensor: one tensor for all layers, addressed by physical slot."""

from __future__ import annotations

import torch

from specserve.shared.runtime.model_config import ModelConfig


class KVCache:
    """K and V for every layer, slot-major: [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]
    (the torch pass's: a block of a layer is one run of rows for every head), or head-major:
    [num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim] (the compiled CPU pass's: one head's
    keys of a block are contiguous, so attention streams them). `write` and `gather` are the torch
    pass's and need slot-major; `move_slots` works on both."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
        head_major: bool = False,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.head_major = head_major
        slots, heads = num_blocks * block_size, config.num_kv_heads
        shape = (config.num_layers, 2) + ((heads, slots) if head_major else (slots, heads)) + (config.head_dim,)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] into physical slots [T]."""
        self.data[layer, 0].index_copy_(0, slots, k)
        self.data[layer, 1].index_copy_(0, slots, v)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_table [B, max_blocks] -> K, V [B, kv_heads, max_blocks * block_size, head_dim].

        Whole blocks are copied as contiguous rows (one index_select each for K and V), which is
        several times faster than gathering slot by slot.
        """
        batch, max_blocks = block_table.shape
        flat = block_table.reshape(-1)
        out = []
        for kind in (0, 1):
            rows = self.data[layer, kind].view(self.num_blocks, -1)
            picked = rows.index_select(0, flat).view(batch, max_blocks * self.block_size, *self.data.shape[-2:])
            out.append(picked.transpose(1, 2))
        return out[0], out[1]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V of physical slots src -> dst in every layer (src is read before any write)."""
        if src.numel() == 0:
            return
        if self.head_major:
            self.data[:, :, :, dst] = self.data[:, :, :, src]
        else:
            self.data[:, :, dst] = self.data[:, :, src]
