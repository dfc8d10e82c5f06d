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

Here: the tests that start no process and open no socket; the others are in tests/service/test_cpu_kernels.py.
"""

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
from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.kernels import KIND_F32, KIND_Q4_1, KIND_Q8_0
from specserve.shared.runtime.lean_model import LeanModel
from specserve.shared.runtime.quant import GGUF_FILE, StoredWeight, dequantize, quantize, read_gguf
from specserve.shared.runtime.random_model import TINY_CONFIG, write_random_model
from specserve.shared.runtime.runner import ModelRunner

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU operators not built: {kernels.error()}")
KINDS = {"float32": KIND_F32, "q8_0": KIND_Q8_0, "q4_1": KIND_Q4_1}
QTYPES = {KIND_Q8_0: GGMLQuantizationType.Q8_0, KIND_Q4_1: GGMLQuantizationType.Q4_1}


def _linear(x: torch.Tensor, w: StoredWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.specserve_cpu.linear(x, w.data, w.scales, w.kind, w.cols, bias)


@pytest.mark.parametrize("kind", [KIND_Q8_0, KIND_Q4_1])
def test_blocks_dequantize_as_gguf_py_does(kind):
    weight = torch.randn(24, 96, generator=torch.Generator().manual_seed(kind))
    blocks = gguf_quantize(weight.numpy(), QTYPES[kind])
    ours = dequantize(StoredWeight.from_blocks(blocks, kind, 24, 96))
    reference = torch.from_numpy(gguf_dequantize(blocks, QTYPES[kind]).astype(np.float32))
    assert torch.equal(ours, reference)
    assert torch.equal(dequantize(quantize(weight, kind)), reference)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cols", [64, 96, 200])
def test_linear_equals_the_dequantized_product(kind, cols):
    if kind != "float32" and cols % 32:
        pytest.skip("quantized rows are whole 32-wide blocks")
    gen = torch.Generator().manual_seed(cols)
    w = quantize(torch.randn(37, cols, generator=gen) * 0.1, KINDS[kind])
    bias = torch.randn(37, generator=gen)
    dense = dequantize(w).double()
    for tokens in (1, 2, 3, 5, 9, 17):
        x = torch.randn(tokens, cols, generator=gen)
        ref = x.double() @ dense.T + bias.double()
        got = _linear(x, w, bias)
        assert got.dtype == torch.float32 and got.shape == (tokens, 37)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_rows_result_does_not_depend_on_the_rest_of_the_call(kind):
    gen = torch.Generator().manual_seed(5)
    w = quantize(torch.randn(50, 128, generator=gen), KINDS[kind])
    x = torch.randn(23, 128, generator=gen)
    whole = _linear(x, w)
    for start, stop in [(0, 1), (7, 8), (3, 5), (4, 11), (9, 23), (0, 16)]:
        assert torch.equal(_linear(x[start:stop], w), whole[start:stop]), (start, stop)


def test_a_killed_builds_lock_file_does_not_hold_up_the_next_build(tmp_path):
    """torch's lock file left by a killed build (every later build or load would wait on it for ever) is removed
    under our own lock, which a second process cannot take while the first holds it."""
    import fcntl

    from specserve.shared.runtime import kernels

    (tmp_path / "lock").touch()  # what a build killed mid-way leaves
    with kernels.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        (tmp_path / "lock").touch()  # torch's lock of a build in progress, under ours
        with open(tmp_path / "specserve.lock", "a") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process waits here: it removes nothing
        assert (tmp_path / "lock").exists()


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


def _runner(model_dir: Path, **kw) -> ModelRunner:
    return ModelRunner.from_dir(model_dir, num_blocks=64, block_size=4, **kw)


def test_gguf_is_read_under_hugging_face_names_unpermuted(gguf_model):
    cfg = json.loads((gguf_model / "config.json").read_text())
    read = read_gguf(gguf_model / GGUF_FILE, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    float32 = load_file(str(gguf_model / "model.safetensors"))
    assert set(read.tensors) == set(float32) and not read.dequantized
    for name, value in read.tensors.items():
        got = dequantize(value) if isinstance(value, StoredWeight) else value
        assert torch.equal(got, float32[name]), name
    assert read.tensors["model.layers.0.self_attn.q_proj.weight"].kind == KIND_Q4_1
    assert read.tensors["model.embed_tokens.weight"].kind == KIND_Q8_0


def test_the_blocks_give_the_float32_models_logits_bit_for_bit(gguf_model):
    blocks = _runner(gguf_model)
    float32 = _runner(gguf_model, weights="float32")
    torch_pass = _runner(gguf_model, kernels="torch")
    assert isinstance(blocks.model, LeanModel) and "q4_1" in blocks.model.source
    assert isinstance(float32.model, LeanModel) and "float32" in float32.model.source
    prompt = [int(t) for t in torch.randint(0, TINY_CONFIG["vocab_size"], (21,), generator=torch.Generator())]
    entry = [Chunk("r", prompt, logits_at=range(len(prompt)))]
    (a,), (b,), (c,) = blocks.forward(entry), float32.forward(entry), torch_pass.forward(entry)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=2e-5)


def test_a_tree_verifies_exactly_what_decoding_one_token_at_a_time_gives(gguf_model):
    gen = torch.Generator().manual_seed(11)
    context = torch.randint(0, TINY_CONFIG["vocab_size"], (30,), generator=gen).tolist()
    path = torch.randint(0, TINY_CONFIG["vocab_size"], (5,), generator=gen).tolist()
    alone = _runner(gguf_model)
    alone.forward([Chunk("r", context)])
    decoded = [alone.forward([Chunk("r", [t], logits_at=[0])])[0][0] for t in path]
    shared = _runner(gguf_model)
    shared.forward([Chunk("r", context), Chunk("other", context[:7])])
    tokens = path + [path[1], path[2]]  # a chain and a side branch under node 0
    parents = [-1, 0, 1, 2, 3, 0, 5]
    (tree, prefill) = shared.forward([Tree("r", tokens, parents), Chunk("other", context[7:19], logits_at=[0, 3])])
    for node in range(5):
        assert torch.equal(tree[node], decoded[node]), node
    lone = _runner(gguf_model)
    lone.forward([Chunk("other", context[:7])])
    (ref,) = lone.forward([Chunk("other", context[7:19], logits_at=[0, 3])])
    assert torch.equal(prefill, ref)
