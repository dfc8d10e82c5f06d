"""Paged attention in Triton for the torch pass on CUDA: every token of a ragged batch against its own keys.

Each new token reads its keys straight from the paged KV pool, with no dense copy: a prefix of its
request's committed slots through the block table, then its tree path (`lean_inputs.LeanInputs`'s key
layout, the same the compiled CPU pass reads). One program per (token, kv head) runs the kv head's
query heads together, streaming the keys in blocks with an online softmax. So decode, prefill chunks,
tree verification and the draft's beam nodes are one kernel.

`attention_reference` is the same computation in torch (gathered keys, a plain softmax): the tests
check the kernel against it through Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, where
`available()` is false for the service (it picks the kernel on CUDA only).

`available()` says whether Triton imports; the kernel itself is defined on first use, so that
TRITON_INTERPRET set by a test before that use applies.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import torch

__all__ = ["attention_reference", "available", "paged_attention"]


@cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, out_ptr,
        tables_ptr, seq_ptr, prefix_ptr, extra_off_ptr, extra_slots_ptr,
        scale,
        stride_qt, stride_qh, stride_kslot, stride_kh, stride_ot, stride_oh, max_blocks,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        t = tl.program_id(0)
        g = tl.program_id(1)
        rows = tl.arange(0, GROUP_PAD)
        head_ok = rows < GROUP
        d = tl.arange(0, D)
        q = tl.load(q_ptr + t * stride_qt + (g * GROUP + rows)[:, None] * stride_qh + d[None, :],
                    mask=head_ok[:, None], other=0.0).to(tl.float32)
        seq = tl.load(seq_ptr + t)
        prefix = tl.load(prefix_ptr + t)
        e0 = tl.load(extra_off_ptr + t)
        n = prefix + tl.load(extra_off_ptr + t + 1) - e0
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for start in range(0, n, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            valid = j < n
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
        out = acc / l_i[:, None]
        tl.store(out_ptr + t * stride_ot + (g * GROUP + rows)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])

    return paged_attention_kernel


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    seq: torch.Tensor, prefix: torch.Tensor, extra_off: torch.Tensor, extra_slots: torch.Tensor,
                    block_size: int, scale: float | None = None, block_n: int = 16) -> torch.Tensor:
    """q [T, H, D] (RoPE applied), one layer's k/v cache [slots, KVH, D] (slot-major, the new tokens' K/V
    already written) -> attention output [T, H, D] in q's dtype. The key layout as in LeanInputs."""
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or dim & (dim - 1) or dim < 16:
        raise ValueError(f"paged_attention needs whole query-head groups and a power-of-two head_dim >= 16, "
                         f"got {heads} heads over {kv_heads}, head_dim {dim}")
    group = heads // kv_heads
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    extra_slots = extra_slots if extra_slots.numel() else extra_slots.new_zeros(1)  # never read; a valid pointer
    _kernel()[(tokens, kv_heads)](
        q, k_cache, v_cache, out, tables, seq, prefix, extra_off, extra_slots,
        1.0 / math.sqrt(dim) if scale is None else scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        tables.shape[1],
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), D=dim,
        BLOCK_N=block_n,
    )
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
