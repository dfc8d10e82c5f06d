"""Weights as stored: GGUF blocks read without dequantizing, under Hugging Face tensor names.

A `StoredWeight` is one 2-D weight in the form the CPU operators (shared/runtime/kernels) multiply directly:
Q4_1 or Q8_0 blocks, or float32. A GGUF block is split at load into its quantized values (as stored:
int8, or nibbles in GGUF's order) and its fp16 scale (and Q4_1's min), widened to float32; the
values it stands for are unchanged (`dequantize` gives them, equal to gguf-py's).
`read_gguf` maps a Llama-architecture GGUF file's tensors onto Hugging Face's names, undoing the
row permutation that llama.cpp's converter applies to q and k (rows move whole, blocks are
untouched). Tensor types other than Q4_1, Q8_0, F32 and F16 are dequantized to float32 (gguf-py's
own dequantizer) and say so in `dequantized`.

`quantize` makes Q8_0 / Q4_1 blocks from a float32 weight with gguf-py's reference quantizer, and
`dequantize` gives the float32 values a StoredWeight stands for (gguf-py's dequantizer: the values
transformers loads from the same file).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specserve.shared.runtime.kernels import KIND_F32, KIND_Q4_1, KIND_Q4_1P, KIND_Q8_0, KIND_Q8_0P, PANEL
from specserve.shared.runtime.model_config import ModelLoadError

GGUF_FILE = "model.gguf"  # the GGUF file kept in a model directory, beside its safetensors (model_store.py writes it)
KIND_NAMES = {KIND_F32: "float32", KIND_Q8_0: "q8_0", KIND_Q4_1: "q4_1"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(slots=True)
class StoredWeight:
    """A [rows, cols] weight in the operators' layout (cpu_ops.cpp):
    float32: `data` float32 [rows, cols], `scales` empty;
    q8_0: `data` uint8 [rows, cols] (int8 values), `scales` float32 [rows, cols / 32];
    q4_1: `data` uint8 [rows, cols / 2] (16 bytes of nibbles a block), `scales` float32 [rows, cols / 32, 2]."""

    data: torch.Tensor
    scales: torch.Tensor
    kind: int
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4

    @classmethod
    def float32(cls, weight: torch.Tensor) -> StoredWeight:
        rows, cols = weight.shape
        return cls(weight.detach().float().contiguous(), torch.empty(0), KIND_F32, rows, cols)

    @classmethod
    def from_blocks(cls, blocks: np.ndarray, kind: int, rows: int, cols: int) -> StoredWeight:
        """GGUF blocks uint8 [rows, blocks * bytes] -> values and float32 scales (exact)."""
        nb = cols // 32
        b = np.ascontiguousarray(blocks).reshape(rows, nb, -1)
        head = 2 if kind == KIND_Q8_0 else 4  # fp16 d (Q8_0), or fp16 d and m (Q4_1)
        shape = (rows, nb) if kind == KIND_Q8_0 else (rows, nb, 2)
        scales = b[:, :, :head].copy().view(np.float16).astype(np.float32).reshape(shape)
        values = b[:, :, head:].reshape(rows, -1)
        return cls(torch.from_numpy(np.ascontiguousarray(values)), torch.from_numpy(np.ascontiguousarray(scales)),
                   kind, rows, cols)


@dataclass(slots=True)
class GgufWeights:
    tensors: dict[str, StoredWeight | torch.Tensor]  # HF name -> 2-D weight, or a 1-D float32 tensor
    dequantized: list[str] = field(default_factory=list)  # names whose type the operators lack

    def describe(self) -> str:
        """Where the weights came from, for logs: "model.gguf (q8_0, q4_1)"."""
        kinds = sorted({w.kind for w in self.tensors.values() if isinstance(w, StoredWeight)})
        text = f"{GGUF_FILE} ({', '.join(KIND_NAMES[k] for k in kinds)})"
        if self.dequantized:
            text += f"; {len(self.dequantized)} tensor(s) of other types dequantized to float32"
        return text


def _hf_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' _reverse_permute_weights), on whole rows."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def read_gguf(path: str | Path, num_heads: int, num_kv_heads: int) -> GgufWeights:
    """Every tensor of a Llama-architecture GGUF file under its Hugging Face name."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    kinds = {GGMLQuantizationType.Q4_1: KIND_Q4_1, GGMLQuantizationType.Q8_0: KIND_Q8_0}
    out = GgufWeights({})
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {t.name!r} has no place in a Llama-family model")
        cols = int(t.shape[0])
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        data = np.asarray(t.data)
        if ".q_proj." in name or ".k_proj." in name:
            heads = num_heads if ".q_proj." in name else num_kv_heads
            data = _unpermute(data.reshape(rows, -1), heads)
        if len(t.shape) == 1:
            out.tensors[name] = torch.from_numpy(np.array(data, dtype=np.float32).reshape(cols))
        elif t.tensor_type in kinds:
            out.tensors[name] = StoredWeight.from_blocks(data.reshape(rows, -1), kinds[t.tensor_type], rows, cols)
        else:
            if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                out.dequantized.append(name)
            values = dequantize(np.ascontiguousarray(data), t.tensor_type).astype(np.float32).reshape(rows, cols)
            out.tensors[name] = StoredWeight.float32(torch.from_numpy(np.ascontiguousarray(values)))
    return out


def _qtype(kind: int) -> Any:
    from gguf import GGMLQuantizationType

    return {KIND_Q8_0: GGMLQuantizationType.Q8_0, KIND_Q4_1: GGMLQuantizationType.Q4_1}[kind]


def quantize(weight: torch.Tensor, kind: int) -> StoredWeight:
    """A float32 [rows, cols] weight as `kind` blocks (gguf-py's reference quantizer), or as float32."""
    if kind == KIND_F32:
        return StoredWeight.float32(weight)
    from gguf.quants import quantize as gguf_quantize

    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"{KIND_NAMES[kind]} needs rows a multiple of 32 wide, not {cols}")
    blocks = gguf_quantize(weight.detach().float().numpy(), _qtype(kind))
    return StoredWeight.from_blocks(blocks, kind, rows, cols)


def dequantize(weight: StoredWeight) -> torch.Tensor:
    """The float32 [rows, cols] values `weight` stands for: d * q (+ m), rounded as gguf-py does."""
    if weight.kind == KIND_F32:
        return weight.data
    nb = weight.cols // 32
    if weight.kind == KIND_Q8_0:
        q = weight.data.view(torch.int8).reshape(weight.rows, nb, 32).float()
        return (weight.scales[:, :, None] * q).reshape(weight.rows, weight.cols)
    packed = weight.data.reshape(weight.rows, nb, 16)
    q = torch.cat((packed & 0xF, packed >> 4), dim=-1).float()  # elements 0-15, then 16-31
    d, m = weight.scales[..., 0:1], weight.scales[..., 1:2]
    return (d * q + m).reshape(weight.rows, weight.cols)


def panels(weight: StoredWeight) -> StoredWeight | None:
    """The same blocks packed in panels of PANEL rows for the int8 products' AVX-512 VNNI code (cpu_ops.cpp,
    kinds Q4_1P / Q8_0P: a 512-bit register holds 4 bytes of each of 16 rows); None for float32 weights and
    rows that are not a multiple of PANEL. A byte permutation (and Q8_0's values + 128): nothing is rounded."""
    if weight.kind not in (KIND_Q4_1, KIND_Q8_0) or weight.rows % PANEL:
        return None
    p, nb = weight.rows // PANEL, weight.cols // 32
    if weight.kind == KIND_Q4_1:
        data = weight.data.reshape(p, PANEL, nb, 4, 4).permute(0, 2, 3, 1, 4)
        scales = weight.scales.reshape(p, PANEL, nb, 2).permute(0, 2, 3, 1)
        kind = KIND_Q4_1P
    else:
        values = (weight.data.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        data = values.reshape(p, PANEL, nb, 8, 4).permute(0, 2, 3, 1, 4)
        scales = weight.scales.reshape(p, PANEL, nb).permute(0, 2, 1)
        kind = KIND_Q8_0P
    return StoredWeight(data.contiguous().reshape(weight.rows, -1), scales.contiguous(), kind, weight.rows,
                        weight.cols)


def concat_rows(parts: list[StoredWeight]) -> StoredWeight:
    """Weights of one input stacked along their output rows (q/k/v, gate/up); one kind for all."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1 or len({p.cols for p in parts}) != 1:
        raise ModelLoadError("fused projections need one weight kind and width for all parts")
    data = torch.cat([p.data for p in parts]).contiguous()
    scales = torch.cat([p.scales for p in parts]).contiguous()
    return StoredWeight(data, scales, parts[0].kind, sum(p.rows for p in parts), parts[0].cols)


ROW_SCALE = ":scale"  # suffix of an int8 matrix's per-row float32 scales, stored beside it under its name + this


def int8_rows(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every floating matrix of `state` as int8 rows with a float32 scale per row (symmetric: a row's largest
    |w| becomes 127; a quarter of float32's bytes, half of bfloat16's), under its name and name + ROW_SCALE;
    other tensors unchanged. The bundled EAGLE head and smollm2-draft are stored so (models/README.md)."""
    out = {}
    for k, v in state.items():
        if v.is_floating_point() and v.dim() == 2:
            scale = v.float().abs().amax(1).clamp_min(1e-12) / 127
            out[k], out[k + ROW_SCALE] = (v.float() / scale[:, None]).round().to(torch.int8), scale
        else:
            out[k] = v
    return out


def float_rows(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """`int8_rows` undone: each int8 matrix that has a ROW_SCALE beside it becomes its rows times their scales,
    in `dtype`; every other tensor unchanged."""
    out = {k: v for k, v in state.items() if not k.endswith(ROW_SCALE)}
    for k in state:
        if k.endswith(ROW_SCALE):
            name = k.removesuffix(ROW_SCALE)
            out[name] = (state[name].float() * state[k][:, None]).to(dtype)
    return out
