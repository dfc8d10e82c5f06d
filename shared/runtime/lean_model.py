"""A Llama-family decoder run by the compiled CPU operators (shared/runtime/kernels): a pass is five calls.

The embedding rows, then every decoder layer in one operator call (norms, projections, RoPE, the KV
write, attention over the paged cache, SwiGLU and residuals, all in C++), then the final norm and the
head on the rows whose logits are wanted. Weights are `StoredWeight`s: a GGUF file's Q4_1 / Q8_0
blocks as stored, weights quantized at load, or float32.

`activations` ("int8" or "float32") picks how the products with Q4_1 / Q8_0 weights run: on activations
quantized to int8 per token per 32-wide block (exact int32 sums per block; faster, close to float32
but not equal) or in float32 (equal to a float32 matmul over the dequantized weights up to summation
order).
Float32 weights always run in float32. Where the int8 products run vector code (AVX-512 VNNI, AVX2), they
read a second copy of the Q4_1 / Q8_0 weights packed in panels of 16 rows (quant.py `panels`), made when the
model is made with int8 activations (or at the first int8 pass, where they are switched on later).

Every operator is batch invariant (cpu_ops.cpp), so a token's logits do not depend on what else
shares its pass: tree verification equals decoding one token at a time, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specserve.shared.runtime.kernels import ACT_F32, ACT_INT8, KIND_F32, KIND_Q4_1, KIND_Q8_0
from specserve.shared.runtime.kv_cache import KVCache
from specserve.shared.runtime.lean_inputs import LeanInputs
from specserve.shared.runtime.model_config import ModelConfig, ModelLoadError
from specserve.shared.runtime.quant import StoredWeight, concat_rows, panels, quantize
from specserve.shared.runtime.rope import RotaryEmbedding

_NO_TENSOR = torch.empty(0)
ACTIVATION_MODES = {"float32": ACT_F32, "int8": ACT_INT8}
# The int8 code (`int8_variant()`) that reads panels, and the weight kinds it reads so: where they measured faster
# than the row layout (docs/lab/cpu_pass.md, "Panels"; AVX2's Q8_0 panels lose at 1-2 tokens)
PANEL_CODE = {"avx512_vnni": (KIND_Q4_1, KIND_Q8_0), "avx2": (KIND_Q4_1,)}


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: StoredWeight
    qkv_bias: torch.Tensor | None
    o: StoredWeight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: StoredWeight
    gate_up_bias: torch.Tensor | None
    down: StoredWeight
    down_bias: torch.Tensor | None

    def operator_args(self) -> tuple[list[torch.Tensor], list[int]]:
        """This layer's 14 tensors and 4 kinds, in decoder_layers' order."""
        tensors = [self.input_norm]
        for weight, bias in ((self.qkv, self.qkv_bias), (self.o, self.o_bias)):
            tensors += [weight.data, weight.scales, _NO_TENSOR if bias is None else bias]
        tensors.append(self.post_norm)
        for weight, bias in ((self.gate_up, self.gate_up_bias), (self.down, self.down_bias)):
            tensors += [weight.data, weight.scales, _NO_TENSOR if bias is None else bias]
        return tensors, [self.qkv.kind, self.o.kind, self.gate_up.kind, self.down.kind]


class LeanModel(torch.nn.Module):
    """`forward(inputs, kv)` -> float32 logits of `inputs.logits_indices`; CPU only, activations int8 or float32."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, config: ModelConfig, embed: StoredWeight, head: StoredWeight, norm: torch.Tensor,
                 layers: list[LayerWeights], source: str, activations: str = "auto"):
        super().__init__()
        if config.sliding_windows and any(w is not None for w in config.sliding_windows):
            raise ModelLoadError("the compiled CPU pass has no sliding-window attention; use the torch pass")
        self.config = config
        self.embed, self.head, self.norm, self.layers = embed, head, norm, layers
        self.source = source  # where the weights came from, for logs: "model.gguf (q4_1, q8_0)", ...
        self.activations = activations
        self.rotary = RotaryEmbedding(config)
        self.keep_features = False  # as CausalLM's: the final norm's output at every token, in `features`
        self.features: torch.Tensor | None = None
        self._tensors: list[torch.Tensor] = []
        self._kinds: list[int] = []
        for layer in layers:
            tensors, kinds = layer.operator_args()
            self._tensors += tensors
            self._kinds += kinds
        # Every weight tensor once, as a buffer: `named_buffers()` is how the draft's offload moves them (it
        # swaps each tensor's data in place, which every reference above sees).
        unique: dict[int, torch.Tensor] = {}
        for tensor in [*self._tensors, embed.data, embed.scales, head.data, head.scales, norm]:
            if tensor.numel():
                unique.setdefault(id(tensor), tensor)
        self._register(unique.values())
        self._packed: dict[int, StoredWeight] = {}  # id of a weight as stored -> its panels
        self._panel_operands: dict[str, tuple[list[torch.Tensor], list[int], StoredWeight]] = {}  # by int8 code
        if self._act == ACT_INT8:
            self._operands()  # the panels packed now, not in a first request's pass

    def _register(self, tensors: Iterable[torch.Tensor]) -> None:
        """Each tensor as a buffer: `named_buffers()` is how the draft's offload moves them."""
        start = sum(1 for _ in self.buffers())
        for i, tensor in enumerate(tensors):
            self.register_buffer(f"weight_{start + i}", tensor, persistent=False)

    def _operands(self) -> tuple[list[torch.Tensor], list[int], StoredWeight]:
        """The decoder layers' tensors and kinds and the head, as this pass's products read them: on int8
        activations, the weights of the kinds PANEL_CODE names for the int8 code in use as panels (packed once:
        for the code in use when the model is made with int8 activations, else at the first such pass), the others
        as stored."""
        code = torch.ops.specserve_cpu.int8_variant() if self._act == ACT_INT8 else ""
        if code not in PANEL_CODE:
            return self._tensors, self._kinds, self.head
        if code not in self._panel_operands:
            kinds_packed = PANEL_CODE[code]

            def pack(w: StoredWeight) -> StoredWeight:
                if w.kind not in kinds_packed:
                    return w
                if id(w) not in self._packed:
                    self._packed[id(w)] = panels(w) or w
                    if self._packed[id(w)] is not w:
                        self._register([self._packed[id(w)].data, self._packed[id(w)].scales])
                return self._packed[id(w)]

            tensors: list[torch.Tensor] = []
            kinds: list[int] = []
            for layer in self.layers:
                t, k = LayerWeights(layer.input_norm, pack(layer.qkv), layer.qkv_bias, pack(layer.o), layer.o_bias,
                                    layer.post_norm, pack(layer.gate_up), layer.gate_up_bias, pack(layer.down),
                                    layer.down_bias).operator_args()
                tensors += t
                kinds += k
            self._panel_operands[code] = (tensors, kinds, pack(self.head))
        return self._panel_operands[code]

    @property
    def activations(self) -> str:
        """How the products with Q4_1 / Q8_0 weights run: "int8" or "float32" (set "auto": float32)."""
        return self._activations

    @activations.setter
    def activations(self, mode: str) -> None:
        if mode == "auto":
            # int8 is faster with AVX-512 VNNI (0.6-0.7x the float32 pass) but its greedy answers are not
            # float32's (on SmolLM2 it changes the quick start's answer): it is asked for, never picked
            mode = "float32"
        if mode not in ACTIVATION_MODES:
            raise ValueError(f"activations must be auto, int8 or float32, not {mode!r}")
        self._activations, self._act = mode, ACTIVATION_MODES[mode]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one pass reads (every projection and the head, plus the norms)."""
        weights = [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(w.nbytes for w in weights) + self.head.nbytes

    @torch.inference_mode()
    def forward(self, inputs: LeanInputs, kv: KVCache) -> torch.Tensor:
        ops = torch.ops.specserve_cpu
        c = self.config
        tensors, kinds, head = self._operands()
        x = ops.embed(inputs.input_ids, self.embed.data, self.embed.scales, self.embed.kind, c.hidden_size)
        cos, sin = self.rotary.looked_up(inputs.positions, torch.float32)
        t, keys = x.shape[0], inputs.keys
        ops.decoder_layers(x, tensors, kinds, cos.reshape(t, -1), sin.reshape(t, -1), kv.data,
                           keys.slot_mapping, keys.tables, keys.seq, keys.prefix, keys.extra_off, keys.extra_slots,
                           keys.block_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, self._act)
        if self.keep_features:
            self.features = ops.rms_norm(x, self.norm, c.rms_norm_eps)
        h = ops.rms_norm(x.index_select(0, inputs.logits_indices), self.norm, c.rms_norm_eps)
        logits: torch.Tensor = ops.linear(h, head.data, head.scales, head.kind, c.hidden_size, None, self._act)
        return logits

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: dict[str, StoredWeight | torch.Tensor], source: str,
                     quantize_to: int | None = None, activations: str = "auto") -> LeanModel:
        """From Hugging Face names -> StoredWeight (2-D) or float32 tensors (norms, biases; 2-D float32
        weights are taken as float32). quantize_to: quantize every float32 projection and the head."""

        def weight(name: str) -> StoredWeight:
            if name not in tensors:
                raise ModelLoadError(f"the weights lack {name}")
            w = tensors[name]
            stored = w if isinstance(w, StoredWeight) else StoredWeight.float32(w)
            if quantize_to is not None and stored.kind == KIND_F32 and stored.cols % 32 == 0:
                stored = quantize(stored.data, quantize_to)
            return stored

        def vector(name: str, required: bool = True) -> torch.Tensor | None:
            w = tensors.get(name)
            if w is None:
                if required:
                    raise ModelLoadError(f"the weights lack {name}")
                return None
            return (w.data if isinstance(w, StoredWeight) else w).reshape(-1).float().contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = [f"{p}self_attn.{n}_proj" for n in "qkv"]
            biases = [vector(f"{n}.bias", required=config.attention_bias) for n in qkv]
            layers.append(LayerWeights(
                input_norm=_required(vector(f"{p}input_layernorm.weight")),
                qkv=concat_rows([weight(f"{n}.weight") for n in qkv]),
                qkv_bias=_cat_optional(*biases),
                o=weight(f"{p}self_attn.o_proj.weight"),
                o_bias=vector(f"{p}self_attn.o_proj.bias", required=config.o_proj_bias),
                post_norm=_required(vector(f"{p}post_attention_layernorm.weight")),
                gate_up=concat_rows([weight(f"{p}mlp.gate_proj.weight"), weight(f"{p}mlp.up_proj.weight")]),
                gate_up_bias=_cat_optional(vector(f"{p}mlp.gate_proj.bias", config.mlp_bias),
                                           vector(f"{p}mlp.up_proj.bias", config.mlp_bias)),
                down=weight(f"{p}mlp.down_proj.weight"),
                down_bias=vector(f"{p}mlp.down_proj.bias", required=config.mlp_bias),
            ))
        embed = weight("model.embed_tokens.weight")
        head = embed if config.tie_word_embeddings or "lm_head.weight" not in tensors else weight("lm_head.weight")
        return cls(config, embed, head, _required(vector("model.norm.weight")), layers, source, activations)


def _required(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None  # vector(required=True) raised otherwise
    return tensor


def _cat_optional(*parts: torch.Tensor | None) -> torch.Tensor | None:
    """The parts end to end, or None when any is missing."""
    present = [p for p in parts if p is not None]
    return torch.cat(present) if len(present) == len(parts) else None
