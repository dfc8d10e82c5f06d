"""The paged KV pool tensor: one tensor for all layers, addressed by physical slot."""

from __future__ import annotations

import torch

from specserve.shared.model_config import ModelConfig


class KVCache:
    """K and V for every layer: [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, 2, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] into physical slots [T]."""
        self.data[layer, 0].index_copy_(0, slots, k)
        self.data[layer, 1].index_copy_(0, slots, v)

    def gather(self, layer: int, slot_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slot_table [B, L] physical slots -> K, V [B, kv_heads, L, head_dim]."""
        k = self.data[layer, 0][slot_table]  # [B, L, kvh, hd]
        v = self.data[layer, 1][slot_table]
        return k.transpose(1, 2), v.transpose(1, 2)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V of physical slots src -> dst in every layer (src is read before any write)."""
        if src.numel() == 0:
            return
        self.data[:, :, dst] = self.data[:, :, src]
