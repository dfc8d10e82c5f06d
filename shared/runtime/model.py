"""A Llama-family decoder (Llama, Qwen2, Mistral) that runs on a paged KV cache.

Module and parameter names follow Hugging Face's checkpoints (model.layers.N.self_attn.o_proj, ...),
except that q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`) are each one fused projection: one
matmul instead of three or two per layer. `checkpoint_views` maps every checkpoint tensor name
(q_proj, k_proj, ... and their biases) onto the rows of our parameters it fills.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.shared.runtime.attention import AttentionMetadata, KeyLayout, paged_attention
from specserve.shared.runtime.kv_cache import KVCache
from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.runtime.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm, in Hugging Face's order: in float32 it computes weight * (x * rsqrt(mean(x^2)
        # + eps)) as HF does (bit-identical on CPU), in one call; other dtypes normalize in float32,
        # cast, then scale, as HF does.
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class FusedLinear(nn.Linear):
    """Several projections of one input as one matmul: `parts` are the checkpoint's module names
    (q_proj, k_proj, v_proj) and their output sizes, stacked along the output rows in that order."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]], bias: bool):
        super().__init__(in_features, sum(size for _, size in parts), bias=bias)
        self.parts = tuple(parts)


def checkpoint_views(model: nn.Module, remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor name of a Hugging Face checkpoint -> the parameter (or the rows of a fused
    parameter) it is loaded into. Tied weights appear under their first name, or under each of
    their names with remove_duplicate=False (as `named_parameters`)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    views: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=remove_duplicate):
        owner, _, kind = name.rpartition(".")
        module = modules[owner]
        if not isinstance(module, FusedLinear):
            views[name] = param
        elif kind == "weight":  # the parts in the checkpoint's order: each one's weight, then its bias
            prefix, start = owner.rpartition(".")[0], 0
            for part, size in module.parts:
                views[f"{prefix}.{part}.weight"] = module.weight.narrow(0, start, size)
                if module.bias is not None:
                    views[f"{prefix}.{part}.bias"] = module.bias.narrow(0, start, size)
                start += size
    return views


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.window = config.sliding_windows[layer] if config.sliding_windows else None
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        parts = (("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size))
        self.qkv_proj = FusedLinear(h, parts, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata | KeyLayout,
    ) -> torch.Tensor:
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # q and k are adjacent heads of one row: RoPE rotates both at once.
        qk = apply_rotary(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.layer, kv_cache, meta, self.window)
        projected: torch.Tensor = self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.intermediate_size = i
        self.gate_up_proj = FusedLinear(h, (("gate_proj", i), ("up_proj", i)), bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split((self.intermediate_size, self.intermediate_size), dim=-1)
        down: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return down


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata | KeyLayout) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        mlp: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # How the pass's attention reads the KV pool: "sdpa" (gathered keys, masks) or "triton" (in place,
        # kernels/triton_attention.py); the loader sets it, ModelRunner builds the inputs it needs.
        self.attention = "sdpa"
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # With keep_features, each pass leaves in `features` the final norm's output at every token
        # [T, hidden] (what the LM head reads; a feature-level draft's input); the logits are unchanged.
        self.keep_features = False
        self.features: torch.Tensor | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata | KeyLayout,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> float32 logits [len(logits_indices), vocab] of the chosen tokens."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        if self.keep_features:
            self.features = self.model.norm(x)
        x = self.model.norm(x.index_select(0, logits_indices))
        logits: torch.Tensor = self.lm_head(x)
        return logits.float()
