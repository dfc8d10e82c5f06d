"""The compiled CPU operators (shared/runtime/kernels) and the weights they multiply as stored (runtime/quant.py).

- Q8_0 / Q4_1 blocks made by gguf-py's quantizer are split and dequantized exactly as gguf-py does it.
- `linear` equals a float64 product over the dequantized weights (float32 rounding only), for every
  weight kind, odd float32 widths included, with the AVX-512 code and with the plain C++ fallback.
- Batch invariance: a row's result is bit-identical whatever other rows share the call.
- A GGUF file written like llama.cpp's converter (q and k rows permuted) is read back under Hugging
  Face names with the permutation undone, and a model run from its blocks gives bit for bit the logits
  of the same model run from the dequantized float32 weights (the same sums, only the weights' storage
  differs), within float32 tolerance of the torch pass.
- A tree verified in one pass gives each node exactly the logits of its path decoded token by token,
  and a request's logits do not change when other requests share its pass.
- Without the operators (SPECSERVE_CPU_KERNELS=off) the loader falls back to the torch pass, saying so.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_cpu_kernels.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file, save_file

from specserve.shared.runtime import kernels
from specserve.shared.runtime.quant import GGUF_FILE
from specserve.shared.runtime.random_model import TINY_CONFIG, write_random_model

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU operators not built: {kernels.error()}")


def test_the_plain_cpp_fallback_agrees(tmp_path):
    """SPECSERVE_CPU_KERNELS_GENERIC=1 runs the plain C++ code: the same products within float32
    rounding, also batch invariant (checked in a process of its own: the choice is made once)."""
    script = tmp_path / "generic.py"
    script.write_text(
        "import torch\n"
        "from specserve.shared.runtime import kernels\n"
        "from specserve.shared.runtime.quant import quantize, dequantize\n"
        "assert kernels.load() and kernels.variant() == 'generic', kernels.variant()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for kind in (0, 1, 2):\n"
        "    w = quantize(torch.randn(19, 96, generator=g), kind)\n"
        "    x = torch.randn(6, 96, generator=g)\n"
        "    y = torch.ops.specserve_cpu.linear(x, w.data, w.scales, w.kind, w.cols, None)\n"
        "    torch.testing.assert_close(y.double(), x.double() @ dequantize(w).double().T, rtol=1e-5, atol=1e-5)\n"
        "    one = torch.ops.specserve_cpu.linear(x[2:3], w.data, w.scales, w.kind, w.cols, None)\n"
        "    assert torch.equal(one[0], y[2])\n"
        "print('ok')\n")
    env = {**os.environ, "SPECSERVE_CPU_KERNELS_GENERIC": "1"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ---- a whole model from a GGUF file --------------------------------------------------------------


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _write_gguf_pair(model_dir: Path) -> None:
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
            blocks = _permute(blocks, heads if ".q_proj." in name else kv_heads)
        writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory) -> Path:
    config = {**TINY_CONFIG, "hidden_size": 128, "intermediate_size": 256}  # rows of whole 32-wide blocks
    model_dir = write_random_model(tmp_path_factory.mktemp("gguf") / "m", config, seed=3, std=0.08)
    _write_gguf_pair(model_dir)
    return model_dir


def test_without_the_operators_the_torch_pass_runs(gguf_model, tmp_path):
    script = tmp_path / "off.py"
    script.write_text(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from specserve.shared.runtime.runner import ModelRunner\n"
        "from specserve.shared.runtime.model import CausalLM\n"
        "r = ModelRunner.from_dir(sys.argv[1], num_blocks=8)\n"
        "assert isinstance(r.model, CausalLM)\n"
        "try:\n"
        "    ModelRunner.from_dir(sys.argv[1], num_blocks=8, kernels='cpu')\n"
        "except Exception as exc:\n"
        "    print('refused:', exc)\n")
    env = {**os.environ, "SPECSERVE_CPU_KERNELS": "off"}
    out = subprocess.run([sys.executable, str(script), str(gguf_model)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch pass, not model.gguf's blocks" in out.stderr and "SPECSERVE_CPU_KERNELS=off" in out.stderr
    assert "refused:" in out.stdout and "cannot run this model" in out.stdout
