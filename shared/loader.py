"""Load a Hugging Face model directory (config.json + safetensors, single file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.shared.model import CausalLM, checkpoint_views
from specserve.shared.model_config import ModelConfig, ModelLoadError
from specserve.shared.rope import inverse_frequencies

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Buffers some checkpoints carry that we recompute instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def parse_device(name: str | torch.device) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but this torch build or machine has no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; choose cpu or cuda")
    return device


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    root = Path(model_dir)
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted({s for s in weight_map.values() if not (root / s).is_file()})
        if missing:
            raise ModelLoadError(f"missing safetensors shard(s) in {root}: {', '.join(missing)}")
        return {name: root / shard for name, shard in weight_map.items()}
    raise ModelLoadError(f"missing weights in {root}: expected model.safetensors or model.safetensors.index.json")


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> CausalLM:
    config = ModelConfig.from_dir(model_dir)
    dtype, device = parse_dtype(dtype), parse_device(device)
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Checkpoint name -> our parameter, or its rows in a fused one (q/k/v, gate/up).
    params = checkpoint_views(model, remove_duplicate=False)
    if config.tie_word_embeddings:
        params.pop("lm_head.weight")
    missing = [name for name in params if name not in files]
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks tensor(s) {', '.join(missing[:8])}")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    if tensor.shape != params[name].shape:
                        raise ModelLoadError(
                            f"{model_dir}: tensor {name} has shape {tuple(tensor.shape)}, "
                            f"config expects {tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor.to(dtype))
    # Buffers are not in checkpoints, and RoPE frequencies stay float32 whatever the weights' dtype.
    model.model.rotary_emb.inv_freq = inverse_frequencies(config)[0].to(device)
    unexpected = [n for n in files if n not in params and n != "lm_head.weight" and not n.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        raise ModelLoadError(f"{model_dir}: checkpoint has tensor(s) this architecture lacks: {unexpected[:8]}")
    return model.eval()
