"""The bench scripts as modules, and hand-made sweep results, for the tests of what reads a sweep
(bench/paper_ratio.py, bench/policy_guard.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py, imported with bench/ on the path (its own imports of sweep and paper_ratio work)."""
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hand_sweep(curves: dict[str, list[tuple[float, float]]], rates=(1.0, 2.0, 3.0)) -> dict:
    """A sweep result with one run a point: {policy: [(attainment, goodput) per rate]}."""
    points = [{"policy": p, "rate": r, "run": 0, "summary": {"attainment": a, "goodput_tok_s": g}}
              for p, curve in curves.items() for r, (a, g) in zip(rates, curve)]
    return {"meta": {"simulated": "llama2-7b-a100"}, "settings": {"rates": list(rates)},
            "policies": list(curves), "points": points}
