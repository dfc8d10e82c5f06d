"""Write a randomly initialised Llama-family model as a Hugging Face directory.

Used by the smoke command before the bundled demo pair exists, by benchmarks, and by tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specserve.shared.runtime.model import CausalLM, checkpoint_views
from specserve.shared.runtime.model_config import ModelConfig

# About 20M parameters: the size class of the demo target (models/target), used by bench/.
BENCH_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

TINY_CONFIG: dict[str, Any] = {
    **BENCH_CONFIG,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def write_random_model(
    out_dir: str | Path, config: dict[str, Any] | None = None, seed: int = 0, std: float = 0.02,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Create `out_dir` with config.json and model.safetensors holding N(0, std) weights."""
    raw = dict(config or TINY_CONFIG)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    tensors = {}
    for name, p in checkpoint_views(model).items():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            value = std * torch.randn(p.shape, generator=gen)
        tensors[name] = value.to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out
