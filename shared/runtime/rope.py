"""Rotary position embeddings with the rope_scaling types that Llama, Qwen2 and Mistral configs use."""

from __future__ import annotations

import math

import torch

from specserve.shared.runtime.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2] float32, attention_scaling) for the config's rope type."""
    params = config.rope
    dim = config.head_dim
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = config.rope_type
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(dim, base, params, config.max_position_embeddings)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, params: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_pos / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of extrapolation per frequency
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)


TABLE_ROWS = 256  # positions computed per call when `looked_up`'s table grows (single-threaded, whole vectors)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE (rotate-half layout) to q and k at arbitrary per-token positions."""

    inv_freq: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # `looked_up`'s float32 cos, sin by position

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, signed sin [T, 1, head_dim] in `dtype` (computed in float32).

        The sin's first half is negated (rotate-half's sign), so `apply_rotary` needs no negation:
        -a * b and a * -b are the same float, so the result is bit-identical to rotate_half's.
        """
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def looked_up(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` read from a table of every position below a power of two past the largest asked (grown
        by doubling): two row gathers a pass instead of its ten operations. The table is `cos_sin` itself,
        TABLE_ROWS positions a call, so a position gets the same floats in any pass (eager CPU passes;
        a captured CUDA graph keeps `cos_sin`, whose table would be reallocated by a longer context)."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self._table is None or self._table[0].shape[0] < need:
            rows = max(TABLE_ROWS, 1 << (need - 1).bit_length())
            parts = [self.cos_sin(torch.arange(s, min(s + TABLE_ROWS, rows), device=self.inv_freq.device),
                                  torch.float32) for s in range(0, rows, TABLE_ROWS)]
            self._table = (torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]))
        cos, sin = self._table
        return cos.index_select(0, positions).to(dtype), sin.index_select(0, positions).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos and signed sin [T, 1, head_dim] from `RotaryEmbedding.cos_sin`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
