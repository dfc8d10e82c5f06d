"""The compiled CPU operators (shared/runtime/kernels) and the weights they multiply as stored (runtime/quant.py).

- Q8_0 / Q4_1 blocks made by gguf-py's quantizer are split and dequantized exactly as gguf-py does it.
- `linear` equals a float64 product over the dequantized weights (float32 rounding only), for every
  weight kind, odd float32 widths included, with every code variant this CPU runs (avx512, avx2, generic;
  switched within the process by `set_variant`).
- Batch invariance: a row's result is bit-identical whatever other rows share the call, in each variant.
- SPECSERVE_CPU_KERNELS_VARIANT picks the variant a process starts with (SPECSERVE_CPU_KERNELS_GENERIC=1:
  generic); a name this CPU cannot run falls back to the best it has, with a warning.
- A GGUF file written like llama.cpp's converter (q and k rows permuted) is read back under Hugging
  Face names with the permutation undone, and a model run from its blocks gives bit for bit the logits
  of the same model run from the dequantized float32 weights (the same sums, only the weights' storage
  differs), within float32 tolerance of the torch pass.
- A tree verified in one pass gives each node exactly the logits of its path decoded token by token,
  and a request's logits do not change when other requests share its pass.
- Without the operators (SPECSERVE_CPU_KERNELS=off) the loader falls back to the torch pass, saying so.
- int8 activations: Q4_1 / Q8_0 products on activations quantized as llama.cpp's Q8_1 equal a float64
  reference that quantizes the same way (the integers exact; float32 rounding only); a token's result is
  bit-identical alone and inside a call of 1..16 tokens, under 1 and 2 threads; the AVX-512 VNNI, AVX2 and
  plain C++ code agree bit for bit; float32 weights stay float32; `activations` "auto" picks int8 for
  quantized weights only, and int8 logits stay within a stated tolerance of the float32 ones.

Here: the tests that start no process and open no socket; the others are in
tests/service/test_cpu_kernels.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file

from specserve.shared.runtime import kernels
from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.kernels import ACT_F32, ACT_INT8, KIND_F32, KIND_Q4_1, KIND_Q4_1P, KIND_Q8_0, KIND_Q8_0P
from specserve.shared.runtime.lean_model import PANEL_CODE, LeanModel
from specserve.shared.runtime.loader import describe
from specserve.shared.runtime.model_config import ModelLoadError
from specserve.shared.runtime.quant import GGUF_FILE, StoredWeight, dequantize, panels, quantize, read_gguf
from specserve.shared.runtime.random_model import TINY_CONFIG
from tests.support.gguf_model import VARIANTS, linear, small_runner

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU operators not built: {kernels.error()}")
KINDS = {"float32": KIND_F32, "q8_0": KIND_Q8_0, "q4_1": KIND_Q4_1}
QTYPES = {KIND_Q8_0: GGMLQuantizationType.Q8_0, KIND_Q4_1: GGMLQuantizationType.Q4_1}


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count (the operators' workers) set to n within, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
def test_linear_equals_the_dequantized_product(kind, cols, variant):
    if kind != "float32" and cols % 32:
        pytest.skip("quantized rows are whole 32-wide blocks")
    gen = torch.Generator().manual_seed(cols)
    w = quantize(torch.randn(37, cols, generator=gen) * 0.1, KINDS[kind])
    bias = torch.randn(37, generator=gen)
    dense = dequantize(w).double()
    for tokens in (1, 2, 3, 5, 9, 17):
        x = torch.randn(tokens, cols, generator=gen)
        ref = x.double() @ dense.T + bias.double()
        got = linear(x, w, bias)
        assert got.dtype == torch.float32 and got.shape == (tokens, 37)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cols", [128, 200])
def test_a_rows_result_does_not_depend_on_the_rest_of_the_call(kind, cols, variant):
    """The same (token, row) bit for bit whatever tokens and rows share the call, and with 2 threads."""
    if kind != "float32" and cols % 32:
        pytest.skip("quantized rows are whole 32-wide blocks")
    gen = torch.Generator().manual_seed(5)
    w = quantize(torch.randn(50, cols, generator=gen), KINDS[kind])
    x = torch.randn(23, cols, generator=gen)
    whole = linear(x, w)
    for start, stop in [(0, 1), (7, 8), (3, 5), (4, 11), (9, 23), (0, 16)]:
        assert torch.equal(linear(x[start:stop], w), whole[start:stop]), (start, stop)
    for start, stop in [(0, 1), (5, 7), (13, 50)]:  # fewer rows: other row tiles
        part = StoredWeight(w.data[start:stop].contiguous(), w.scales[start:stop].contiguous(), w.kind, stop - start,
                            w.cols)
        assert torch.equal(linear(x, part), whole[:, start:stop]), (start, stop)
    with _threads(2):
        assert torch.equal(linear(x, w), whole)


def test_the_variants_vector_helpers_agree_with_torch(variant):
    """rms_norm (sum of squares) against torch in float64, odd widths included."""
    gen = torch.Generator().manual_seed(2)
    for width in (8, 13, 64, 100, 576):
        x, weight = torch.randn(3, width, generator=gen), torch.randn(width, generator=gen)
        ref = weight.double() * (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5))
        torch.testing.assert_close(torch.ops.specserve_cpu.rms_norm(x, weight, 1e-5).double(), ref, rtol=1e-5,
                                   atol=1e-5)


def test_set_variant_refuses_unknown_names():
    with pytest.raises(RuntimeError, match="unknown CPU kernel variant"):
        kernels.set_variant("sse9")
    assert kernels.variant() in VARIANTS


def test_the_build_folder_is_keyed_by_the_cpu_where_the_build_targets_it(monkeypatch, tmp_path):
    """On x86 one build serves every CPU (its variants are picked at run time): the folder says x86_64. Elsewhere
    the build targets the building CPU (-mcpu=native): the folder names a hash of that CPU's description."""
    monkeypatch.setenv("SPECSERVE_KERNELS_DIR", str(tmp_path))
    if kernels.X86:
        assert kernels.isa_tag() == "x86_64" and "-mcpu=native" not in kernels.CFLAGS
        assert kernels.build_dir().name.endswith("-x86_64") and kernels.build_dir().parent == tmp_path
    monkeypatch.setattr(kernels, "X86", False)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    tag = kernels.isa_tag()
    assert tag.startswith("aarch64-") and len(tag) == len("aarch64-") + 10
    assert kernels.build_dir().name.endswith(tag)


# ---- int8 activations ------------------------------------------------------------------------------


def _q8_1(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's Q8_1 of each token's 32-wide blocks, in float32 as the operators do it: d = max|x| / 127,
    q = x * (1 / d) rounded half to even, s = d * sum(q). Returns q [T, nb, 32], d and s [T, nb]."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inverse[..., None]), -127, 127)
    return q, d, (d * q.sum(-1).astype(np.float32)).astype(np.float32)


def _int8_reference(x: torch.Tensor, w: StoredWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Per block the exact integer dot product of the stored integers with the Q8_1 activations, scaled
    (Q4_1: d_w * d_x * sum + m_w * s_x; Q8_0: d_w * d_x * sum) and summed, in float64."""
    q, d, s = _q8_1(x)
    nb = w.cols // 32
    if w.kind == KIND_Q4_1:
        packed = w.data.numpy().reshape(w.rows, nb, 16)
        ints = np.concatenate([packed & 15, packed >> 4], -1).astype(np.float64)
        scales = w.scales.numpy().reshape(w.rows, nb, 2).astype(np.float64)
        sums = np.einsum("rbe,tbe->trb", ints, q.astype(np.float64))
        out = (sums * scales[None, :, :, 0] * d[:, None, :] + scales[None, :, :, 1] * s[:, None, :]).sum(-1)
    else:
        ints = w.data.numpy().view(np.int8).reshape(w.rows, nb, 32).astype(np.float64)
        scales = w.scales.numpy().reshape(w.rows, nb).astype(np.float64)
        out = (np.einsum("rbe,tbe->trb", ints, q.astype(np.float64)) * scales[None] * d[:, None, :]).sum(-1)
    return torch.from_numpy(out) + (0 if bias is None else bias.double())


@pytest.mark.parametrize("kind", [KIND_Q8_0, KIND_Q4_1])
@pytest.mark.parametrize("cols", [32, 96, 128, 576, 1536])
def test_int8_products_equal_the_q8_1_reference(kind, cols):
    """Widths of 1 to 48 blocks, whole groups of 4 and not: within float32 rounding of the exact sums (a
    single activation rounded otherwise than the reference would be off by about 1e-3 of the scale)."""
    gen = torch.Generator().manual_seed(cols + kind)
    w = quantize(torch.randn(37, cols, generator=gen) * 0.1, kind)
    bias = torch.randn(37, generator=gen)
    for tokens in (1, 3, 9):
        x = torch.randn(tokens, cols, generator=gen) * 3
        got, ref = linear(x, w, bias, ACT_INT8), _int8_reference(x, w, bias)
        assert got.dtype == torch.float32 and got.shape == (tokens, 37)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        # and within int8 quantization of the float32 product
        exact = x.double() @ dequantize(w).double().T + bias.double()
        assert (got.double() - exact).abs().max() <= 0.02 * exact.abs().max()


def test_int8_keeps_zero_blocks_and_float32_weights_exact():
    """An all-zero activation block (d = 0) contributes nothing; float32 weights take the float32 path."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 96, generator=gen)
    x[:, 32:64] = 0
    for kind in (KIND_Q8_0, KIND_Q4_1):
        w = quantize(torch.randn(10, 96, generator=gen), kind)
        torch.testing.assert_close(linear(x, w, act=ACT_INT8).double(), _int8_reference(x, w), rtol=1e-5,
                                   atol=1e-5)
    w = quantize(torch.randn(10, 96, generator=gen), KIND_F32)
    assert torch.equal(linear(x, w, act=ACT_INT8), linear(x, w, act=ACT_F32))
    with pytest.raises(RuntimeError, match="unknown activation mode"):
        linear(x, quantize(torch.randn(10, 96, generator=gen), KIND_Q8_0), act=7)


def _as_stored(w: StoredWeight) -> StoredWeight:
    return w


def _as_panels(w: StoredWeight) -> StoredWeight:
    packed = panels(w)
    assert packed is not None
    return packed


# layout: (how a weight is laid out, the seed, its rows, the rows of a part of it)
LAYOUTS = {"rows": (_as_stored, 6, 70, (5, 40)), "panels": (_as_panels, 7, 96, (16, 64))}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", [KIND_Q8_0, KIND_Q4_1])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_rows_do_not_depend_on_the_rest_of_the_call(layout, kind, threads, variant):
    """In the row layout and in panels (16 rows side by side), under each variant."""
    lay, seed, rows, (lo, hi) = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(rows, 576, generator=gen), kind)
    x = torch.randn(23, 576, generator=gen)
    with _threads(threads):
        whole = linear(x, lay(w), act=ACT_INT8)
        for start, stop in [(0, 1), (7, 8), (3, 5), (4, 11), (9, 23), (0, 16), (5, 14)]:
            assert torch.equal(linear(x[start:stop], lay(w), act=ACT_INT8), whole[start:stop]), (start, stop)
        assert torch.equal(linear(x, lay(quantize(dequantize(w)[lo:hi], kind)), act=ACT_INT8), whole[:, lo:hi])


@pytest.mark.parametrize("kind", [KIND_Q8_0, KIND_Q4_1])
def test_panels_equal_the_q8_1_reference_in_every_variant_bit_for_bit(kind, variant):
    """The same blocks packed in panels of 16 rows (int8 activations only): within float32 rounding of the
    exact sums, under each variant (AVX-512 VNNI's code or plain C++'s), the same bits as plain C++'s."""
    gen = torch.Generator().manual_seed(40 + kind)
    for cols in (32, 96, 576, 1536):
        w = quantize(torch.randn(48, cols, generator=gen) * 0.1, kind)
        packed = panels(w)
        assert packed is not None and packed.kind == {KIND_Q8_0: KIND_Q8_0P, KIND_Q4_1: KIND_Q4_1P}[kind]
        assert packed.nbytes == w.nbytes
        bias = torch.randn(48, generator=gen)
        x = torch.randn(9, cols, generator=gen) * 3
        got, ref = linear(x, packed, bias, ACT_INT8), _int8_reference(x, w, bias)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        current = torch.ops.specserve_cpu.variant()
        torch.ops.specserve_cpu.set_variant("generic")
        try:
            assert torch.equal(linear(x, packed, bias, ACT_INT8), got), cols
        finally:
            torch.ops.specserve_cpu.set_variant(current)


def test_panels_are_refused_where_they_do_not_apply():
    gen = torch.Generator().manual_seed(8)
    assert panels(quantize(torch.randn(40, 64, generator=gen), KIND_Q4_1)) is None  # rows not a multiple of 16
    assert panels(quantize(torch.randn(32, 64, generator=gen), KIND_F32)) is None
    packed = panels(quantize(torch.randn(32, 64, generator=gen), KIND_Q8_0))
    assert packed is not None
    x = torch.randn(2, 64, generator=gen)
    with pytest.raises(RuntimeError, match="int8 activations only"):
        linear(x, packed, act=ACT_F32)
    with pytest.raises(RuntimeError, match="row layout"):
        torch.ops.specserve_cpu.embed(torch.tensor([1]), packed.data, packed.scales, packed.kind, packed.cols)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.specserve_cpu.linear(x, packed.data[:8], packed.scales[:1], packed.kind, packed.cols, None,
                                       ACT_INT8)


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


def test_the_blocks_give_the_float32_models_logits_bit_for_bit(gguf_model, variant):
    blocks = small_runner(gguf_model, activations="float32")
    float32 = small_runner(gguf_model, weights="float32")
    torch_pass = small_runner(gguf_model, kernels="torch")
    assert isinstance(blocks.model, LeanModel) and "q4_1" in blocks.model.source
    assert isinstance(float32.model, LeanModel) and "float32" in float32.model.source
    prompt = [int(t) for t in torch.randint(0, TINY_CONFIG["vocab_size"], (21,), generator=torch.Generator())]
    entry = [Chunk("r", prompt, logits_at=range(len(prompt)))]
    (a,), (b,), (c,) = blocks.forward(entry), float32.forward(entry), torch_pass.forward(entry)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_a_tree_verifies_exactly_what_decoding_one_token_at_a_time_gives(gguf_model, variant, activations):
    gen = torch.Generator().manual_seed(11)
    context = torch.randint(0, TINY_CONFIG["vocab_size"], (30,), generator=gen).tolist()
    path = torch.randint(0, TINY_CONFIG["vocab_size"], (5,), generator=gen).tolist()
    alone = small_runner(gguf_model, activations=activations)
    assert alone.model.activations == activations
    alone.forward([Chunk("r", context)])
    decoded = [alone.forward([Chunk("r", [t], logits_at=[0])])[0][0] for t in path]
    shared = small_runner(gguf_model, activations=activations)
    shared.forward([Chunk("r", context), Chunk("other", context[:7])])
    tokens = path + [path[1], path[2]]  # a chain and a side branch under node 0
    parents = [-1, 0, 1, 2, 3, 0, 5]
    (tree, prefill) = shared.forward([Tree("r", tokens, parents), Chunk("other", context[7:19], logits_at=[0, 3])])
    for node in range(5):
        assert torch.equal(tree[node], decoded[node]), node
    lone = small_runner(gguf_model, activations=activations)
    lone.forward([Chunk("other", context[:7])])
    (ref,) = lone.forward([Chunk("other", context[7:19], logits_at=[0, 3])])
    assert torch.equal(prefill, ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_int8_a_token_in_a_tree_of_1_to_16_equals_it_decoded_alone(gguf_model, threads):
    """Under int8 activations, node i of a chain of n = 1..16 nodes gets bit for bit the logits of its path
    decoded one token at a time (decoded under 1 thread, verified under `threads`)."""
    gen = torch.Generator().manual_seed(12)
    context = torch.randint(0, TINY_CONFIG["vocab_size"], (9,), generator=gen).tolist()
    path = torch.randint(0, TINY_CONFIG["vocab_size"], (16,), generator=gen).tolist()
    runner = small_runner(gguf_model, activations="int8")
    runner.forward([Chunk("r", context)])
    decoded = [runner.forward([Chunk("r", [t], logits_at=[0])])[0][0] for t in path]
    runner.release("r")
    with _threads(threads):
        for n in range(1, 17):
            runner.forward([Chunk("r", context)])
            (tree,) = runner.forward([Tree("r", path[:n], [-1, *range(n - 1)])])
            runner.discard_tree("r")
            runner.release("r")
            for node in range(n):
                assert torch.equal(tree[node], decoded[node]), (n, node)


def test_int8_reads_panels_where_its_code_is_vectorized(gguf_model):
    """With AVX-512 VNNI or AVX2 the int8 pass multiplies panels of the same blocks: each product is the row
    layout's up to float32 summation order, which can move a later layer's activation across an int8
    rounding step, so the logits are the row layout's (the plain C++ code's, switched in-process) within
    int8 quantization."""
    if torch.ops.specserve_cpu.int8_variant() not in PANEL_CODE:
        pytest.skip("the int8 products run the row layout on this CPU")
    prompt = torch.randint(0, TINY_CONFIG["vocab_size"], (20,), generator=torch.Generator().manual_seed(5)).tolist()
    entry = [Chunk("r", prompt, logits_at=range(len(prompt)))]
    runner = small_runner(gguf_model, activations="int8")
    (packed,) = runner.forward(entry)
    tensors, kinds, head = runner.model._operands()
    as_panels = {KIND_Q4_1: KIND_Q4_1P, KIND_Q8_0: KIND_Q8_0P}
    read = {as_panels[k] if k in PANEL_CODE[torch.ops.specserve_cpu.int8_variant()] else k
            for k in runner.model._kinds + [runner.model.head.kind]}
    assert set(kinds) | {head.kind} == read and read & {KIND_Q4_1P, KIND_Q8_0P}
    current = torch.ops.specserve_cpu.variant()
    torch.ops.specserve_cpu.set_variant("generic")
    try:
        rows = small_runner(gguf_model, activations="int8")
        (by_rows,) = rows.forward(entry)
        assert rows.model._operands()[2].kind in (KIND_Q4_1, KIND_Q8_0)
    finally:
        torch.ops.specserve_cpu.set_variant(current)
    assert (packed - by_rows).abs().max() <= 0.02 * by_rows.abs().max()
    assert (packed.argmax(-1) == by_rows.argmax(-1)).float().mean() >= 0.9


def test_int8_panels_are_packed_when_the_model_is_made(gguf_model):
    """The panels exist before the first pass (a first request's pass does not pack them); float32 packs none."""
    if torch.ops.specserve_cpu.int8_variant() not in PANEL_CODE:
        pytest.skip("the int8 products run the row layout on this CPU")
    assert small_runner(gguf_model, activations="int8").model._packed
    assert not small_runner(gguf_model, activations="float32").model._packed


def test_the_activation_mode_switch(gguf_model):
    """auto: float32; int8 logits within 5% of the logits' scale of the float32
    ones, with mostly the same argmax; int8 with the torch pass is refused."""
    by_default = "float32"
    assert small_runner(gguf_model).model.activations == by_default
    assert small_runner(gguf_model, weights="q8_0").model.activations == by_default
    auto = small_runner(gguf_model, activations="int8")
    assert "int8 activations" in describe(auto.model)
    assert small_runner(gguf_model, weights="float32").model.activations == "float32"
    assert small_runner(gguf_model, weights="float32", activations="int8").model.activations == "int8"
    prompt = torch.randint(0, TINY_CONFIG["vocab_size"], (40,), generator=torch.Generator().manual_seed(4)).tolist()
    entry = [Chunk("r", prompt, logits_at=range(len(prompt)))]
    (int8,) = auto.forward(entry)
    float32 = small_runner(gguf_model, activations="float32")
    (exact,) = float32.forward(entry)
    assert not torch.equal(int8, exact)
    assert (int8 - exact).abs().max() <= 0.05 * exact.abs().max()
    assert (int8.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    auto.model.activations = "float32"  # switched on a loaded model
    auto.release("r")
    assert torch.equal(auto.forward(entry)[0], exact)
    with pytest.raises(ValueError, match="activations must be"):
        auto.model.activations = "int4"
    with pytest.raises(ModelLoadError, match="cannot run this model"):
        small_runner(gguf_model, kernels="torch", activations="int8")
