"""Load a Hugging Face model directory (config.json + safetensors, single file or sharded; model.gguf).

Two passes run a model: the compiled CPU operators' (`LeanModel`: CPU, float32 activations, weights
as stored) and the torch pass (`CausalLM`: any device and dtype, float32 / bfloat16 / float16 weights).
`load_model` picks by `kernels` and `weights` (WEIGHTS and KERNELS say what each choice means), and the
compiled pass's products by `activations` (ACTIVATIONS).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.shared.runtime import kernels as cpu_kernels
from specserve.shared.runtime.kernels import KIND_Q4_1, KIND_Q8_0
from specserve.shared.runtime.lean_model import LeanModel
from specserve.shared.runtime.model import CausalLM, checkpoint_views
from specserve.shared.runtime.model_config import ModelConfig, ModelLoadError
from specserve.shared.runtime.model_store import PACKED, unpack
from specserve.shared.runtime.quant import GGUF_FILE, StoredWeight, read_gguf
from specserve.shared.runtime.rope import inverse_frequencies

log = logging.getLogger(__name__)

WEIGHTS = {
    "auto": "the blocks of the directory's model.gguf as stored where it has one, else its float32 weights",
    "float32": "the float32 safetensors",
    "q8_0": "the float32 weights quantized to Q8_0 at load (compiled CPU operators only)",
    "q4_1": "the float32 weights quantized to Q4_1 at load (compiled CPU operators only)",
}
KERNELS = {
    "auto": "the compiled CPU operators on CPU in float32 (built on first use); on CUDA the torch pass with "
            "Triton attention where Triton imports; the torch pass with SDPA elsewhere",
    "cpu": "the compiled CPU operators, or an error",
    "triton": "the torch pass with Triton paged attention (CUDA; on CPU only under TRITON_INTERPRET=1, for tests)",
    "torch": "the torch pass with SDPA attention (float32 safetensors; CUDA graphs on CUDA)",
}

ACTIVATIONS = {
    "auto": "float32 (int8 is faster with AVX-512 VNNI but its greedy answers are not float32's: ask for it)",
    "int8": "the compiled CPU pass multiplies Q4_1 / Q8_0 weights on activations quantized to int8 per token per "
            "32-wide block: faster, close to float32 (not equal), batch invariant",
    "float32": "float32 activations throughout: the products equal float32 ones over the dequantized weights up "
               "to summation order (transformers' logits within float32 tolerance)",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --dtype: "auto" is bfloat16 on CUDA (as the peers serve), float32 elsewhere (the compiled CPU pass's dtype).
DTYPE_CHOICES = ["auto", *DTYPES]
DTYPE_HELP = "weights and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)"
# Buffers some checkpoints carry that we recompute instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def parse_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype or its name; "auto" is bfloat16 on a CUDA `device`, else float32."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def dtype_name(name: str, device: str | torch.device) -> str:
    """The name of the dtype `name` resolves to on `device` ("auto" -> "bfloat16" on CUDA)."""
    return str(parse_dtype(name, device)).removeprefix("torch.")


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
    if not single.is_file() and (packed := single.with_name(single.name + PACKED)).is_file():
        unpack(packed)  # a bundled model committed compressed (shared/runtime/model_store.py)
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
    model_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    weights: str = "auto",
    kernels: str = "auto",
    activations: str = "auto",
) -> CausalLM | LeanModel:
    """The model of `model_dir`, run by the pass `kernels` picks, from the weights `weights` picks, the compiled
    pass's products on the activations `activations` picks."""
    if weights not in WEIGHTS or kernels not in KERNELS or activations not in ACTIVATIONS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, kernels one of {', '.join(KERNELS)} and "
                         f"activations one of {', '.join(ACTIVATIONS)}")
    config = ModelConfig.from_dir(model_dir)
    device = parse_device(device)
    dtype = parse_dtype(dtype, device)
    why_not = _why_not_lean(config, dtype, device, kernels)
    model: CausalLM | LeanModel
    if why_not is None:
        model = _load_lean(model_dir, config, weights, activations)
    elif kernels == "cpu" or weights in ("q8_0", "q4_1") or activations == "int8":
        raise ModelLoadError(f"{model_dir}: the compiled CPU operators cannot run this model: {why_not}")
    else:
        if kernels == "auto" and weights == "auto" and (Path(model_dir) / GGUF_FILE).is_file():
            log.warning("%s: running the float32 weights through the torch pass, not %s's blocks: %s",
                        model_dir, GGUF_FILE, why_not)
        model = _load_causal_lm(model_dir, config, dtype, device)
        model.attention = _attention(config, device, kernels)
    log.info("%s: %s", model_dir, describe(model))
    return model


def _attention(config: ModelConfig, device: torch.device, kernels: str) -> str:
    """How the torch pass reads the KV pool: "triton" (asked, or on CUDA by default where Triton imports and
    the model has no sliding window) or "sdpa"."""
    from specserve.shared.runtime.kernels import triton_attention

    windowed = any(w is not None for w in config.sliding_windows)
    if kernels == "triton":
        if windowed or not triton_attention.available():
            raise ModelLoadError("--kernels triton: " + ("the model has sliding-window attention, which the Triton "
                                 "kernel lacks" if windowed else "Triton is not installed"))
        return "triton"
    if kernels == "auto" and device.type == "cuda" and not windowed and triton_attention.available():
        return "triton"
    return "sdpa"


def describe(model: CausalLM | LeanModel) -> str:
    """Which pass runs the model, and on which weights (for logs and `specserve smoke`)."""
    if isinstance(model, LeanModel):
        return (f"compiled CPU operators ({cpu_kernels.variant()}), weights {model.source}, "
                f"{model.activations} activations, {model.weight_bytes / 2**20:.0f} MiB read per pass")
    param = next(model.parameters())
    return f"torch pass ({model.attention} attention), {str(param.dtype).removeprefix('torch.')} on {param.device}"


def _why_not_lean(config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: str) -> str | None:
    """None where the compiled CPU pass can run the model, else why not."""
    if kernels in ("torch", "triton"):
        return f"--kernels {kernels}"
    if device.type != "cpu" or dtype != torch.float32:
        return f"it runs on CPU in float32 only (asked: {device.type}, {str(dtype).removeprefix('torch.')})"
    if any(w is not None for w in config.sliding_windows):
        return "the model has sliding-window attention, which the compiled pass lacks"
    if not cpu_kernels.load():
        return f"they are not built ({cpu_kernels.error()})"
    return None


def _load_lean(model_dir: str | Path, config: ModelConfig, weights: str, activations: str) -> LeanModel:
    if weights == "auto" and (Path(model_dir) / GGUF_FILE).is_file():
        read = read_gguf(Path(model_dir) / GGUF_FILE, config.num_heads, config.num_kv_heads)
        _check_shapes(model_dir, config, read.tensors)
        return LeanModel.from_tensors(config, read.tensors, read.describe(), activations=activations)
    # The float32 weights, checked and fused as the torch pass loads them, then handed over.
    model = _load_causal_lm(model_dir, config, torch.float32, torch.device("cpu"))
    tensors: dict[str, StoredWeight | torch.Tensor] = {k: v.detach() for k, v in checkpoint_views(model).items()}
    quantize_to = {"q8_0": KIND_Q8_0, "q4_1": KIND_Q4_1}.get(weights)
    source = "model.safetensors (float32" + (f", quantized to {weights} at load)" if quantize_to else ")")
    return LeanModel.from_tensors(config, tensors, source, quantize_to=quantize_to, activations=activations)


def _check_shapes(model_dir: str | Path, config: ModelConfig, tensors: dict[str, StoredWeight | torch.Tensor]) -> None:
    """Every tensor the architecture needs, of its shape, and no other (as the safetensors loader checks)."""
    with torch.device("meta"):
        expected = {name: tuple(p.shape) for name, p in checkpoint_views(CausalLM(config), False).items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ModelLoadError(f"{model_dir}: {GGUF_FILE} lacks tensor(s) {', '.join(missing[:8])}")
    for name, tensor in tensors.items():
        shape = (tensor.rows, tensor.cols) if isinstance(tensor, StoredWeight) else tuple(tensor.shape)
        if name not in expected and not (name == "lm_head.weight" and config.tie_word_embeddings):
            raise ModelLoadError(f"{model_dir}: {GGUF_FILE} has tensor {name}, which this architecture lacks")
        if name in expected and shape != expected[name]:
            raise ModelLoadError(f"{model_dir}: tensor {name} has shape {shape}, config expects {expected[name]}")


def _load_causal_lm(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    device = parse_device(device)
    dtype = parse_dtype(dtype, device)
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
