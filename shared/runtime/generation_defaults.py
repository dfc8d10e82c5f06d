"""A model's own sampling defaults (vLLM's `--generation-config auto`): what a request that leaves them out gets.

`generation_defaults(model_dir)` reads, for temperature, top_p, top_k, repetition_penalty and min_p:
1. the model directory's generation_config.json (Hugging Face's keys of those names);
2. for a key it lacks, the metadata of the directory's model.gguf, where llama.cpp's converter wrote
   `general.sampling.temp`, `.top_p`, `.top_k`, `.min_p` or `.penalty_repeat` (llama.cpp applies
   its repeat penalty over its last `penalty_last_n` tokens; here, as in vLLM, it covers the prompt
   and the whole output).
What neither holds is left out: the gateway's own defaults (OpenAI's) apply. A value the sampler
would refuse is a `ModelLoadError` naming the file and the key, so a bad file stops the gateway at
start instead of failing requests. As vLLM does, `do_sample` is not read: a model's temperature
applies even where its file says `do_sample: false`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specserve.shared.runtime.model_config import ModelLoadError
from specserve.shared.runtime.quant import GGUF_FILE

GENERATION_CONFIG = "generation_config.json"
# Our (Hugging Face's and vLLM's) name -> llama.cpp's GGUF metadata key
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "repetition_penalty": "general.sampling.penalty_repeat",
    "min_p": "general.sampling.min_p",
}
VALID: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: math.isfinite(v) and v == int(v) and v >= -1, "an integer >= -1 (-1 and 0: off)"),
    "repetition_penalty": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def generation_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The model's sampling defaults that its files hold (see the module's docstring), by field name."""
    found: dict[str, float | int] = {}
    for source, values in ((GENERATION_CONFIG, _from_json(Path(model_dir) / GENERATION_CONFIG)),
                           (GGUF_FILE, _from_gguf(Path(model_dir) / GGUF_FILE))):
        for name, value in values.items():
            if name not in found:
                found[name] = _checked(source, name, value)
    return found


def _checked(source: str, name: str, value: Any) -> float | int:
    ok, wanted = VALID[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(float(value)):
        raise ModelLoadError(f"{source}: {name} must be {wanted}, got {value!r}")
    return int(value) if name == "top_k" else float(value)


def _from_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return {name: raw[name] for name in GGUF_KEYS if raw.get(name) is not None}


def _from_gguf(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    from gguf import GGUFReader

    try:
        fields = GGUFReader(str(path)).fields
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path} cannot be read as GGUF: {exc}") from exc
    out = {}
    for name, key in GGUF_KEYS.items():
        field = fields.get(key)
        if field is not None:
            out[name] = field.contents()
    return out


__all__ = ["GENERATION_CONFIG", "GGUF_KEYS", "generation_defaults"]
