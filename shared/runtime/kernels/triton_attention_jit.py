"""The Triton kernels of triton_attention.py (which imports this module on first use, so that TRITON_INTERPRET set
by a test before then applies): each token's keys in parts of a fixed size, then the parts combined in order
(flash-decoding's split).

A token's keys: a prefix of its request's committed slots through the block table, then its tree path (the
key layout of `lean_inputs.LeanInputs`). One program per (tile of TILE consecutive tokens, kv head, part) runs
the tile's tokens and the kv head's query heads together, streaming the keys in blocks of BLOCK_N with an online
softmax per token (`attend`). Where every token of a tile belongs to one request (a tree's nodes, a chunk's
tokens), a block inside the prefix they all read is loaded once for the tile; elsewhere each token's block is
gathered through its own slots. Either way each token takes the same arithmetic (a batched dot, a token per
batch row), over blocks at the same absolute key offsets, and a block past a token's keys leaves its running
state unchanged, so its output depends on its own keys alone, not on what shares its tile or its call (a call
of short contexts is not given a kernel of its own).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend(  # type: ignore[no-untyped-def]
    q, k_ptr, v_ptr, tables_ptr, seq, prefix, n, e0, extra_slots_ptr, shared_seq, common, g, lo, hi, scale,
    stride_kslot, stride_kh, max_blocks, d,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Keys lo..hi-1 (at most) of a tile's tokens against their query heads q [TILE, GROUP_PAD, D] (float32); per
    token (seq, prefix, its key count n, its path's offset e0: [TILE] each) only keys below its n count. Keys
    below `common` are the prefix every token of the tile reads through table row `shared_seq`. Returns the
    running max, the softmax's sum [TILE, GROUP_PAD] and the output not yet divided by it [TILE, GROUP_PAD, D]."""
    m_i = tl.full([TILE, GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE, GROUP_PAD], tl.float32)
    acc = tl.zeros([TILE, GROUP_PAD, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        if start + BLOCK_N <= common:  # the tile's shared prefix: one load for every token
            shared_block = tl.load(tables_ptr + shared_seq * max_blocks + j // BLOCK_SIZE)
            shared_at = (shared_block.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE)[:, None] * stride_kslot \
                + g * stride_kh + d[None, :]
            k = tl.broadcast_to(tl.load(k_ptr + shared_at).to(tl.float32)[None, :, :], (TILE, BLOCK_N, D))
            v = tl.broadcast_to(tl.load(v_ptr + shared_at).to(tl.float32)[None, :, :], (TILE, BLOCK_N, D))
        else:  # each token's own slots: its prefix through its table row, then its tree path
            jj = j[None, :]
            valid = jj < n[:, None]
            in_prefix = jj < prefix[:, None]
            block = tl.load(tables_ptr + seq[:, None] * max_blocks + jj // BLOCK_SIZE, mask=valid & in_prefix,
                            other=0)
            extra = tl.load(extra_slots_ptr + e0[:, None] + (jj - prefix[:, None]),
                            mask=valid & (jj >= prefix[:, None]), other=0)
            slot = tl.where(in_prefix, block.to(tl.int64) * BLOCK_SIZE + jj % BLOCK_SIZE, extra.to(tl.int64))
            offsets = slot[:, :, None] * stride_kslot + g * stride_kh + d[None, None, :]
            k = tl.load(k_ptr + offsets, mask=valid[:, :, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offsets, mask=valid[:, :, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k, (0, 2, 1)), input_precision="ieee") * scale
        s = tl.where((j[None, :] < n[:, None])[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile's slot with no key yet: 0s, not NaNs
        p = tl.exp(s - m_sub[:, :, None])
        alpha = tl.exp(m_i - m_sub)  # 1 for a token this block is past: its state goes on unchanged
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def split_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, tables_ptr, seq_ptr, prefix_ptr, extra_off_ptr, extra_slots_ptr, scale,
    stride_qt, stride_qh, stride_kslot, stride_kh, max_blocks, splits, tokens,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_N: tl.constexpr, TILE: tl.constexpr,
):
    """Grid (tiles, kv heads, splits): part s of the keys (SPLIT_N keys from s * SPLIT_N) of tokens
    tile * TILE ... + TILE - 1; each token's max and sum into ml [tokens, heads, splits, 2], its undivided output
    into part [tokens, heads, splits, D]. Nothing is stored for a token past its keys (`combine_kernel` reads
    only the token's own parts)."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    t = tile * TILE + tl.arange(0, TILE)
    t_ok = t < tokens
    seq = tl.load(seq_ptr + t, mask=t_ok, other=0)
    prefix = tl.load(prefix_ptr + t, mask=t_ok, other=0)
    e0 = tl.load(extra_off_ptr + t, mask=t_ok, other=0)
    n = prefix + tl.load(extra_off_ptr + t + 1, mask=t_ok, other=0) - e0
    lo = sp * SPLIT_N
    longest = tl.max(n, 0)
    if lo < longest:
        shared_seq = tl.load(seq_ptr + tile * TILE)
        one_request = tl.sum(tl.where(t_ok & (seq != shared_seq), 1, 0), 0) == 0
        common = tl.where(one_request, tl.min(tl.where(t_ok, prefix, 2147483647), 0), 0)
        rows = tl.arange(0, GROUP_PAD)
        head_ok = rows < GROUP
        d = tl.arange(0, D)
        heads = g * GROUP + rows
        q = tl.load(q_ptr + t[:, None, None] * stride_qt + heads[None, :, None] * stride_qh + d[None, None, :],
                    mask=(t_ok[:, None] & head_ok[None, :])[:, :, None], other=0.0).to(tl.float32)
        hi = tl.minimum(lo + SPLIT_N, longest)
        m_i, l_i, acc = attend(q, k_ptr, v_ptr, tables_ptr, seq, prefix, n, e0, extra_slots_ptr, shared_seq, common,
                               g, lo, hi, scale, stride_kslot, stride_kh, max_blocks, d, BLOCK_SIZE, TILE, GROUP_PAD,
                               D, BLOCK_N)
        row = ((t[:, None] * tl.num_programs(1) * GROUP + heads[None, :]) * splits + sp).to(tl.int64)
        keep = (t_ok & (lo < n))[:, None] & head_ok[None, :]
        tl.store(part_ptr + row[:, :, None] * D + d[None, None, :], acc, mask=keep[:, :, None])
        tl.store(ml_ptr + row * 2, m_i, mask=keep)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=keep)


@triton.jit
def combine_kernel(  # type: ignore[no-untyped-def]
    part_ptr, ml_ptr, out_ptr, prefix_ptr, extra_off_ptr, stride_ot, stride_oh, splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, SPLIT_N: tl.constexpr,
):
    """Grid (tokens, kv heads): a token's parts merged in order, and divided by the softmax's sum."""
    t = tl.program_id(0)
    g = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    head_ok = rows < GROUP
    d = tl.arange(0, D)
    e0 = tl.load(extra_off_ptr + t)
    n = tl.load(prefix_ptr + t) + tl.load(extra_off_ptr + t + 1) - e0
    base = (t * tl.num_programs(1) * GROUP + g * GROUP + rows) * splits
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for sp in range(0, tl.cdiv(n, SPLIT_N)):
        row = (base + sp).to(tl.int64)
        m_s = tl.load(ml_ptr + row * 2, mask=head_ok, other=0.0)
        l_s = tl.load(ml_ptr + row * 2 + 1, mask=head_ok, other=1.0)  # (padding rows: no 0 / 0)
        part = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        alpha = tl.exp(m_i - m_new)
        beta = tl.exp(m_s - m_new)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + part * beta[:, None]
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + (g * GROUP + rows)[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
