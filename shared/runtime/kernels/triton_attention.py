"""Paged attention in Triton for the torch pass on CUDA: every token of a ragged batch against its own keys.

Each new token reads its keys straight from the paged KV pool, with no dense copy: a prefix of its
request's committed slots through the block table, then its tree path (`lean_inputs.LeanInputs`'s key
layout, the same the compiled CPU pass reads). One program per (tile of consecutive tokens, kv head) runs
the tile's tokens and the kv head's query heads together, streaming the keys in blocks with an online softmax
per token; the tokens of one request in a tile (a tree's nodes, a chunk's tokens) read the blocks of the prefix
they share once. Tiles hold `TILE_TOKENS` tokens in a call where some request has several, one otherwise.
So decode, prefill chunks, tree verification and the draft's beam nodes are one kernel. Contexts are split
(flash-decoding): parts of `SPLIT_N` keys, one program each, merged in order by a second kernel, so that a few
long requests still fill the GPU's cores.

`attention_reference` is the same computation in torch (gathered keys, a plain softmax): the tests
check the kernel against it through Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, where
`available()` is false for the service (it picks the kernel on CUDA only).

`available()` says whether Triton imports; the kernels (triton_attention_jit.py) are imported on first use, so
that TRITON_INTERPRET set by a test before that use applies.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import torch

__all__ = ["SPLIT_N", "TILE_TOKENS", "attention_reference", "available", "paged_attention"]

SPLIT_N = 512  # keys per part of a context (flash-decoding's split; vLLM's paged attention v2 also uses 512)
TILE_TOKENS = 4  # consecutive tokens per program: a tree's nodes share their prefix's reads in tiles of this many


@cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _jit() -> Any:
    from specserve.shared.runtime.kernels import triton_attention_jit

    return triton_attention_jit


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    seq: torch.Tensor, prefix: torch.Tensor, extra_off: torch.Tensor, extra_slots: torch.Tensor,
                    block_size: int, scale: float | None = None, block_n: int = 16,
                    split_n: int = SPLIT_N, tile: int | None = None) -> torch.Tensor:
    """q [T, H, D] (RoPE applied), one layer's k/v cache [slots, KVH, D] (slot-major, the new tokens' K/V
    already written) -> attention output [T, H, D] in q's dtype. The key layout as in LeanInputs.

    Each token's keys are split in parts of `split_n`, and each part of `tile` consecutive tokens is one
    program; the parts are combined in order by a second kernel (the grid has as many parts as the block
    table's width and the tree paths allow a token). A token's parts depend on its own keys alone, so its output
    does not depend on what shares its tile or its call. `tile` by default: `TILE_TOKENS` where some table row
    has several tokens (a tree, a chunk, beam nodes: they share their prefix's reads), else 1 (decodes alone:
    tiles of other requests' decodes would share no read, and a lone decode would run 4 tokens' arithmetic)."""
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or dim & (dim - 1) or dim < 16 or split_n % block_n:
        raise ValueError(f"paged_attention needs whole query-head groups, a power-of-two head_dim >= 16 and parts "
                         f"of whole key blocks, got {heads} heads over {kv_heads}, head_dim {dim}, parts of "
                         f"{split_n} keys in blocks of {block_n}")
    group = heads // kv_heads
    if tile is None:
        tile = TILE_TOKENS if tokens > tables.shape[0] else 1
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"paged_attention's tile is a power of two, got {tile}")
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    extra_slots = extra_slots if extra_slots.numel() else extra_slots.new_zeros(1)  # never read; a valid pointer
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    shape = {"BLOCK_SIZE": block_size, "GROUP": group, "GROUP_PAD": max(16, 1 << (group - 1).bit_length()),
             "D": dim}
    splits = -(-(tables.shape[1] * block_size + extra_slots.numel()) // split_n)  # the most keys a token can have
    jit = _jit()
    part = torch.empty(tokens, heads, splits, dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(tokens, heads, splits, 2, dtype=torch.float32, device=q.device)
    jit.split_kernel[(-(-tokens // tile), kv_heads, splits)](
        q, k_cache, v_cache, part, ml, tables, seq, prefix, extra_off, extra_slots, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.shape[1], splits, tokens,
        BLOCK_N=block_n, SPLIT_N=split_n, TILE=tile, **shape)
    jit.combine_kernel[(tokens, kv_heads)](part, ml, out, prefix, extra_off, out.stride(0), out.stride(1), splits,
                                           GROUP=group, GROUP_PAD=shape["GROUP_PAD"], D=dim, SPLIT_N=split_n)
    return out


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                        seq: torch.Tensor, prefix: torch.Tensor, extra_off: torch.Tensor, extra_slots: torch.Tensor,
                        block_size: int, scale: float | None = None) -> torch.Tensor:
    """`paged_attention` in torch, one token at a time: its keys gathered, a float32 softmax."""
    tokens, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    out = torch.empty_like(q)
    for t in range(tokens):
        n_prefix = int(prefix[t])
        table = tables[int(seq[t])].long()
        logical = torch.arange(n_prefix, device=q.device)
        slots = torch.cat([table[logical // block_size] * block_size + logical % block_size,
                           extra_slots[int(extra_off[t]):int(extra_off[t + 1])].long()])
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[t].float(), k) * scale
        out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
