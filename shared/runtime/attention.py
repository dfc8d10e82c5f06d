"""Paged attention over a ragged batch, with per-entry masks (causal chunks or token trees).

Two ways, by the metadata the pass built: `AttentionMetadata` (SDPA over gathered keys, below; any
device, sliding windows) or a `KeyLayout` (each token's keys read in place by the Triton kernel,
kernels/triton_attention.py; CUDA, no sliding windows).

The new tokens of every entry are flattened into one [T] axis for the projections and MLP. For
attention, entries are split into a few groups of similar query length; within a group, queries
are scattered into a padded [B, max_q] layout, keys and values are gathered from the paged pool
block by block into [B, max_blocks * block_size], and one masked SDPA call covers the group. The mask says
exactly what each query may see: all of its request's committed context, plus the new tokens
that precede it (chunk) or are its ancestors (tree), and nothing of other requests.

The lean cases need less (batch.py decides): a group without padding skips the scatter and gather
of its queries; a lone decode token or a lone first chunk has no mask at all (its keys are cut to
its own length, the chunk is `is_causal`); single-token decodes of several requests get a mask
that only cuts each one's keys at its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F

from specserve.shared.runtime.kv_cache import KVCache


@dataclass(slots=True)
class AttentionGroup:
    """Entries whose queries share one padded SDPA call (see batch.attention_groups)."""

    rows: torch.Tensor | None  # [Tg] int64 rows of the flat batch in this group; None = all, in order
    block_table: torch.Tensor  # [Bg, max_blocks] int64: KV blocks of each entry (padding -> block 0)
    query_dest: torch.Tensor  # [Tg] int64: index of each query in the flattened [Bg * max_q] layout
    batch_size: int
    max_q: int
    # [Bg, 1, max_q, max_kv] bool masks, keyed by sliding window (None = full attention); broadcastable
    # shapes allowed. Empty: no mask (a lone entry that sees all of its keys, cut to `kv_len`).
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    kv_len: int | None = None  # keys (tokens) each entry attends over; None = every gathered slot
    causal: bool = False  # no mask, and the queries are the last kv_len keys' causal chunk from key 0


@dataclass(slots=True)
class KeyLayout:
    """Where each new token's K/V goes and which keys it reads."""

    slot_mapping: torch.Tensor  # [T] int64: the physical KV slot each new token is written to
    tables: torch.Tensor  # [B, max_blocks] int32: each entry's block table (padding: 0)
    seq: torch.Tensor  # [T] int32: row of `tables` of each token
    prefix: torch.Tensor  # [T] int32: leading logical slots of its request each token reads
    extra_off: torch.Tensor  # [T + 1] int32: CSR offsets into extra_slots
    extra_slots: torch.Tensor  # [E] int32: physical slots of each tree node's path, root first
    block_size: int

    def to(self, device: torch.device) -> KeyLayout:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return KeyLayout(move(self.slot_mapping), move(self.tables), move(self.seq), move(self.prefix),
                         move(self.extra_off), move(self.extra_slots), self.block_size)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: physical KV slot each new token is written to
    groups: list[AttentionGroup]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    kv_cache: KVCache,
    meta: AttentionMetadata | KeyLayout,
    window: int | None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens -> attention output [T, H, D].

    Writes the new k/v into the pool first, so the gathered keys include them.
    """
    kv_cache.write(layer, k, v, meta.slot_mapping)
    if isinstance(meta, KeyLayout):
        from specserve.shared.runtime.kernels.triton_attention import paged_attention as triton_attention

        return triton_attention(q, kv_cache.data[layer, 0], kv_cache.data[layer, 1], meta.tables, meta.seq,
                                meta.prefix, meta.extra_off, meta.extra_slots, meta.block_size)
    if len(meta.groups) == 1 and meta.groups[0].rows is None:
        return _group_attention(q, layer, kv_cache, meta.groups[0], window)
    out = torch.empty_like(q)
    for group in meta.groups:
        rows = cast(torch.Tensor, group.rows)  # None only for a lone group covering all rows, handled above
        out.index_copy_(0, rows, _group_attention(q.index_select(0, rows), layer, kv_cache, group, window))
    return out


def _group_attention(
    q: torch.Tensor, layer: int, kv_cache: KVCache, group: AttentionGroup, window: int | None
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    rows = group.batch_size * group.max_q
    dense = rows == num_tokens  # no padding: the queries are already in the [Bg, max_q] layout
    if dense:
        padded = q
    else:
        padded = q.new_zeros(rows, num_heads, head_dim)
        padded.index_copy_(0, group.query_dest, q)
    padded = padded.view(group.batch_size, group.max_q, num_heads, head_dim).transpose(1, 2)
    keys, values = kv_cache.gather(layer, group.block_table)
    if group.kv_len is not None:
        keys, values = keys[:, :, : group.kv_len], values[:, :, : group.kv_len]
    out = F.scaled_dot_product_attention(
        padded, keys, values, attn_mask=group.masks[window] if group.masks else None, is_causal=group.causal,
        enable_gqa=num_heads != keys.shape[1],
    )
    out = out.transpose(1, 2).reshape(rows, num_heads, head_dim)
    return out if dense else out.index_select(0, group.query_dest)
