"""Presets: the latency and acceptance models of one simulated setting, from a TOML file.

`--simulate SPEC` takes a preset name (a file presets/<name>.toml next to this module) or the path
of a .toml file, optionally followed by overrides: `NAME,time_scale=4` multiplies every modelled
pass time (target and draft) by 4. A slowed clock keeps the model's shape and makes the gateway's
own per-iteration CPU time 4x smaller beside it: the setting of a GPU server whose gateway has
cores of its own, on a machine where it shares two (docs/simulation.md, "Time scale").
Relative paths inside a preset are looked up next to it, then in the repository.
Every preset says where its numbers come from (`sources`) and which are assumptions.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specserve.shared.simulate.acceptance import AcceptanceModel
from specserve.shared.simulate.latency import LatencyModel

PRESETS = Path(__file__).resolve().parent / "presets"
DEFAULT_CORPUS = ["bench/workloads/short.jsonl", "bench/workloads/medium.jsonl"]
REPO = Path(__file__).resolve().parent.parent.parent


class PresetError(ValueError):
    """A missing or malformed preset (one line, naming the problem)."""


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    path: Path
    target: LatencyModel
    draft: LatencyModel
    acceptance: AcceptanceModel
    corpus: tuple[Path, ...]  # JSONL files whose text is the true continuation
    tokenizer: Path  # tokenizer.json the corpus is tokenized with (the target's)
    seed: int
    sources: tuple[str, ...]
    time_scale: float = 1.0  # every modelled pass time multiplied by this (the spec's override)

    @property
    def spec(self) -> str:
        """A `--simulate` spec that loads this preset again, overrides included (for child services)."""
        return str(self.path) + (f",time_scale={self.time_scale!r}" if self.time_scale != 1.0 else "")


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.toml"))


def resolve(spec: str) -> Path:
    if not spec:
        raise PresetError(f"--simulate needs a preset name ({', '.join(preset_names())}) or a .toml file")
    path = Path(spec)
    if spec.endswith(".toml") or path.is_file():
        if not path.is_file():
            raise PresetError(f"--simulate {spec}: no such preset file")
        return path
    path = PRESETS / f"{spec}.toml"
    if not path.is_file():
        raise PresetError(f"--simulate {spec}: unknown preset (known: {', '.join(preset_names())}; or a .toml file)")
    return path


def _latency(raw: Any, where: str) -> LatencyModel:
    if not isinstance(raw, dict):
        raise PresetError(f"{where}: missing table")
    try:
        return LatencyModel(tuple(int(t) for t in raw["tokens"]), tuple(float(m) for m in raw["ms"]),
                            float(raw.get("per_request_ms", 0.0)), float(raw.get("per_context_token_us", 0.0)),
                            float(raw.get("per_pair_ns", 0.0)), _flag(raw.get("padded_attention", False), where))
    except KeyError as exc:
        raise PresetError(f"{where}: missing key {exc}") from None
    except (TypeError, ValueError) as exc:
        raise PresetError(f"{where}: {exc}") from None


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise PresetError(f"{where}: padded_attention must be true or false, got {value!r}")
    return value


def split_spec(spec: str) -> tuple[str, float]:
    """'NAME[,time_scale=F]' -> (NAME, F); F defaults to 1."""
    name, *overrides = spec.split(",")
    scale = 1.0
    for item in overrides:
        key, sep, value = item.partition("=")
        if key.strip() != "time_scale" or not sep:
            raise PresetError(f"--simulate {spec}: unknown override {item!r} (known: time_scale=F)")
        try:
            scale = float(value)
        except ValueError:
            raise PresetError(f"--simulate {spec}: time_scale must be a number, got {value!r}") from None
        if not 0 < scale < 1e6:
            raise PresetError(f"--simulate {spec}: time_scale must be > 0, got {value}")
    return name, scale


def scaled(model: LatencyModel, scale: float) -> LatencyModel:
    """Every time of the model multiplied by `scale`."""
    return replace(model, ms=tuple(m * scale for m in model.ms), per_request_ms=model.per_request_ms * scale,
                   per_context_token_us=model.per_context_token_us * scale, per_pair_ns=model.per_pair_ns * scale)


def load_preset(spec: str) -> Preset:
    spec, scale = split_spec(spec)
    path = resolve(spec)
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PresetError(f"--simulate {spec}: {path.name} is not valid TOML ({exc})") from None
    name = str(raw.get("name", path.stem))
    where = f"preset {name} ({path.name})"
    acc = raw.get("acceptance")
    if not isinstance(acc, dict):
        raise PresetError(f"{where}: missing [acceptance] table")
    try:
        acceptance = AcceptanceModel(tuple(float(a) for a in acc["depth_accept"]), float(acc.get("rank_tail", 0.5)),
                                     float(acc.get("concentration", 4.0)))
    except KeyError as exc:
        raise PresetError(f"{where} [acceptance]: missing key {exc}") from None
    except (TypeError, ValueError) as exc:
        raise PresetError(f"{where} [acceptance]: {exc}") from None
    target = scaled(_latency(raw.get("target"), f"{where} [target]"), scale)
    draft = scaled(_latency(raw.get("draft"), f"{where} [draft]"), scale)
    text = raw.get("text", {})
    corpus = tuple(_find(path, f, where) for f in text.get("corpus", DEFAULT_CORPUS))
    tokenizer = _find(path, text.get("tokenizer", "models/target/tokenizer.json"), where)
    return Preset(name, path, target, draft, acceptance, corpus, tokenizer, int(text.get("seed", 0)),
                  tuple(str(s) for s in raw.get("sources", [])), scale)


def _find(preset: Path, name: str, where: str) -> Path:
    """A file named in a preset: as given if absolute, else next to the preset or in the repository."""
    for base in (preset.resolve().parent, REPO):
        if (base / name).is_file():
            return base / name
    raise PresetError(f"{where}: text file {name} not found (next to the preset or in the repository)")
