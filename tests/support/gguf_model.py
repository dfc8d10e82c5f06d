"""A tiny random Llama model with its GGUF file, as a named model's install lays one out, and the CPU
kernel variant fixture: shared by the kernel tests of tests/unit and tests/service."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file, save_file

from specserve.shared.runtime import kernels
from specserve.shared.runtime.kernels import ACT_F32
from specserve.shared.runtime.quant import GGUF_FILE, StoredWeight
from specserve.shared.runtime.random_model import TINY_CONFIG, write_random_model
from specserve.shared.runtime.runner import ModelRunner

VARIANTS = kernels.variants() if kernels.load() else []


def linear(x: torch.Tensor, w: StoredWeight, bias: torch.Tensor | None = None, act: int = ACT_F32) -> torch.Tensor:
    """The compiled `linear` operator on a weight as stored."""
    return torch.ops.specserve_cpu.linear(x, w.data, w.scales, w.kind, w.cols, bias, act)


def small_runner(model_dir: Path, **kw) -> ModelRunner:
    """A small-pool runner of a model directory."""
    return ModelRunner.from_dir(model_dir, num_blocks=64, block_size=4, **kw)


@pytest.fixture(params=VARIANTS)
def variant(request):
    """Each code variant this CPU runs, in turn; the one the process started with afterwards."""
    before = kernels.set_variant(request.param)
    yield request.param
    kernels.set_variant(before)


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf_pair(model_dir: Path) -> None:
    """Quantize a float32 model directory into model.gguf as llama.cpp lays a Llama file out (projections
    Q4_1, embedding Q8_0, norms F32), and make its safetensors the float32 values of those blocks, as a
    named model's install does."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    tensors = load_file(str(model_dir / "model.safetensors"))
    writer = GGUFWriter(str(model_dir / GGUF_FILE), "llama")
    dequantized = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if name.startswith("model.layers."):
            module = ".".join(parts[3:-1])  # self_attn.q_proj, input_layernorm, ...
            gguf_name = f"blk.{parts[2]}.{names[module]}.{parts[-1]}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        array = value.numpy()
        if value.dim() == 1:
            writer.add_tensor(gguf_name, array)
            dequantized[name] = value
            continue
        qtype = GGMLQuantizationType.Q8_0 if "embed" in name or "lm_head" in name else GGMLQuantizationType.Q4_1
        blocks = gguf_quantize(array, qtype)
        dequantized[name] = torch.from_numpy(gguf_dequantize(blocks, qtype).astype(np.float32))
        if ".q_proj." in name or ".k_proj." in name:
            blocks = permute(blocks, heads if ".q_proj." in name else kv_heads)
        writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module", params=[(4, 2), (2, 1)], ids=["head_dim32", "head_dim64"])
def gguf_model(tmp_path_factory, request) -> Path:
    heads, kv_heads = request.param  # the attention code of head width 32 and 64 (SmolLM2's)
    config = {**TINY_CONFIG, "hidden_size": 128, "intermediate_size": 256,  # rows of whole 32-wide blocks
              "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    model_dir = write_random_model(tmp_path_factory.mktemp("gguf") / "m", config, seed=3, std=0.08)
    write_gguf_pair(model_dir)
    return model_dir
