"""ModelConfig: the subset of a Hugging Face config.json that our Llama-family runtime needs.

Covers LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM. Both the transformers 4.x
layout (`rope_theta` + `rope_scaling`) and the 5.x layout (`rope_parameters`) are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelLoadError(RuntimeError):
    """A model directory cannot be loaded: a missing file or tensor, or an unsupported config."""


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    mlp_bias: bool
    # Bias on o_proj: Llama's `attention_bias` covers q/k/v *and* o_proj; Qwen2 has it on q/k/v only.
    o_proj_bias: bool = False
    rope: dict[str, Any] = field(default_factory=dict)  # rope_type, rope_theta and its scaling keys
    # Per layer: the sliding attention window in tokens, or None for full attention.
    sliding_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def rope_type(self) -> str:
        rope_type: str = self.rope.get("rope_type", "default")
        return rope_type

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(raw.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r} (model_type={raw.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in raw:
                raise ModelLoadError(f"config.json is missing required key {key!r}")
        num_heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        num_layers = int(raw["num_hidden_layers"])
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            o_proj_bias=arch == "LlamaForCausalLM" and bool(raw.get("attention_bias", False)),
            rope=_rope_params(raw),
            sliding_windows=_sliding_windows(raw, arch, num_layers),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"model directory not found: {model_dir}")
        if not path.is_file():
            raise ModelLoadError(f"missing config.json in model directory {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"config.json in {model_dir} is not valid JSON: {exc}") from exc
        cfg = cls.from_dict(raw)
        # Like transformers' generate, stop on generation_config.json's EOS ids as well.
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            try:
                gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            except json.JSONDecodeError as exc:
                raise ModelLoadError(f"generation_config.json in {model_dir} is not valid JSON: {exc}") from exc
            cfg.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + _token_ids(gen_eos)))
        return cfg

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv if self.attention_bias else 0) + (h if self.o_proj_bias else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


def _token_ids(value: int | list[int] | None) -> list[int]:
    """An `eos_token_id` field (absent, one id or a list) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _arch_from_model_type(model_type: str | None) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
    }.get(model_type or "", f"<model_type {model_type!r}>")


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers 5.x: rope_parameters holds everything; 4.x: rope_theta + optional rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling")
    if scaling:
        params.update(scaling)
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("unsupported rope setting: partial_rotary_factor != 1.0")
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
    return params


def _sliding_windows(raw: dict[str, Any], arch: str, num_layers: int) -> list[int | None]:
    window = raw.get("sliding_window")
    if not window:
        return [None] * num_layers
    if arch == "MistralForCausalLM":
        return [int(window)] * num_layers
    if arch == "Qwen2ForCausalLM":
        if not raw.get("use_sliding_window", False):
            return [None] * num_layers
        layer_types = raw.get("layer_types")
        if layer_types:
            return [int(window) if t == "sliding_attention" else None for t in layer_types]
        first_full = int(raw.get("max_window_layers", num_layers))
        return [int(window) if i >= first_full else None for i in range(num_layers)]
    return [None] * num_layers
