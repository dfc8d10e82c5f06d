"""Paged attention over a ragged batch, with per-entry masks (causal chunks or token trees).

The new tokens of every entry are flattened into one [T] axis for the projections and MLP. For
attention they are scattered into a padded [B, max_q] layout, keys and values are gathered from
the paged pool into [B, max_kv], and one masked SDPA call covers the whole batch. The mask says
exactly what each query may see: all of its request's committed context, plus the new tokens
that precede it (chunk) or are its ancestors (tree), and nothing of other requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.shared.kv_cache import KVCache


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: physical KV slot each new token is written to
    slot_table: torch.Tensor  # [B, max_kv] int64: physical slot of every key position (padding -> 0)
    query_dest: torch.Tensor  # [T] int64: index of each new token in the flattened [B * max_q] layout
    batch_size: int
    max_q: int
    # [B, 1, max_q, max_kv] bool masks, keyed by sliding window (None = full attention).
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    window: int | None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens -> attention output [T, H, D].

    Writes the new k/v into the pool first, so the gathered keys include them.
    """
    kv_cache.write(layer, k, v, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    padded = q.new_zeros(meta.batch_size * meta.max_q, num_heads, head_dim)
    padded.index_copy_(0, meta.query_dest, q)
    padded = padded.view(meta.batch_size, meta.max_q, num_heads, head_dim).transpose(1, 2)
    keys, values = kv_cache.gather(layer, meta.slot_table)
    out = F.scaled_dot_product_attention(
        padded, keys, values, attn_mask=meta.masks[window], enable_gqa=num_heads != keys.shape[1]
    )
    out = out.transpose(1, 2).reshape(meta.batch_size * meta.max_q, num_heads, head_dim)
    return out.index_select(0, meta.query_dest)
