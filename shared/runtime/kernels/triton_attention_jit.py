"""The Triton kernels of triton_attention.py (which imports this module on first use, so that TRITON_INTERPRET set
by a test before then applies): each token's keys in parts of a fixed size, one program each, then the parts
combined in order (flash-decoding's split).

A token's keys: a prefix of its request's committed slots through the block table, then its tree path (the
key layout of `lean_inputs.LeanInputs`). One program per (token, kv head) runs the kv head's query heads
together, streaming the keys in blocks of BLOCK_N with an online softmax (`attend`). A token's parts and
their order depend on its own keys alone, and every token takes the same two kernels, so its output does not
depend on what shares its call (a call of short contexts is not given a kernel of its own).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend(  # type: ignore[no-untyped-def]
    q, k_ptr, v_ptr, tables_ptr, seq, prefix, e0, extra_slots_ptr, g, lo, hi, scale, stride_kslot, stride_kh,
    max_blocks, d,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Keys lo..hi-1 of one token against its query heads q [GROUP_PAD, D] (float32): the running max, the
    softmax's sum and the output not yet divided by it."""
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        valid = j < hi
        in_prefix = j < prefix
        block = tl.load(tables_ptr + seq * max_blocks + j // BLOCK_SIZE, mask=valid & in_prefix, other=0)
        extra = tl.load(extra_slots_ptr + e0 + (j - prefix), mask=valid & (j >= prefix), other=0)
        slot = tl.where(in_prefix, block.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE, extra.to(tl.int64))
        offsets = slot[:, None] * stride_kslot + g * stride_kh + d[None, :]
        k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def split_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, tables_ptr, seq_ptr, prefix_ptr, extra_off_ptr, extra_slots_ptr, scale,
    stride_qt, stride_qh, stride_kslot, stride_kh, max_blocks, splits,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_N: tl.constexpr,
):
    """Grid (tokens, kv heads, splits): part s of a token's keys (SPLIT_N keys from s * SPLIT_N); its max and
    sum into ml [tokens, heads, splits, 2], its undivided output into part [tokens, heads, splits, D]. A
    program past the token's keys stores nothing (`combine_kernel` reads only the token's own parts)."""
    t = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    prefix = tl.load(prefix_ptr + t)
    e0 = tl.load(extra_off_ptr + t)
    n = prefix + tl.load(extra_off_ptr + t + 1) - e0
    lo = sp * SPLIT_N
    if lo < n:
        rows = tl.arange(0, GROUP_PAD)
        head_ok = rows < GROUP
        d = tl.arange(0, D)
        q = tl.load(q_ptr + t * stride_qt + (g * GROUP + rows)[:, None] * stride_qh + d[None, :],
                    mask=head_ok[:, None], other=0.0).to(tl.float32)
        hi = tl.minimum(lo + SPLIT_N, n)
        m_i, l_i, acc = attend(q, k_ptr, v_ptr, tables_ptr, tl.load(seq_ptr + t), prefix, e0, extra_slots_ptr, g,
                               lo, hi, scale, stride_kslot, stride_kh, max_blocks, d, BLOCK_SIZE, GROUP_PAD, D,
                               BLOCK_N)
        row = ((t * tl.num_programs(1) * GROUP + g * GROUP + rows) * splits + sp).to(tl.int64)
        tl.store(part_ptr + row[:, None] * D + d[None, :], acc, mask=head_ok[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=head_ok)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=head_ok)


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
