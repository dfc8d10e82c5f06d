"""Fit the simulation's latency model (shared/simulate/latency.py) to measured passes of the
bundled target and draft, in process, one torch thread (as `specserve up` runs each service on
2 cores).

    .venv/bin/python bench/sim_fit_latency.py [--out bench/results/sim_fit_latency.json]

Each pass is n requests x k tree nodes at context c (every request prefilled to c tokens first,
untimed; the tree is discarded after the call so the context stays c), plus single prefill chunks.
Median of --repeats timed calls after one warm-up. The model
    pass_ms = table(T) + per_request_ms * n + per_context_token_us / 1000 * n * c + per_pair_ns / 1e6 * n * k * c
is linear in its parameters (the table's values at fixed knots are the coefficients of hat
functions), so it is fitted by least squares (relative error; negative linear terms are dropped);
the report gives each point's measured and fitted time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specserve.shared.batch import Chunk, Tree
from specserve.shared.runner import ModelRunner
from specserve.shared.simulate.latency import LatencyModel

KNOTS = (1, 2, 8, 16, 32, 64, 128, 256, 512)


def measure(model_dir: Path, grid: list[tuple[int, int, int]], chunks: list[tuple[int, int]],
            repeats: int) -> list[dict]:
    runner = ModelRunner.from_dir(model_dir, num_blocks=4096)
    rng = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    points = []
    for n, k, c in grid:
        rids = [f"r{n}-{k}-{c}-{i}" for i in range(n)]
        runner.forward([Chunk(r, torch.randint(1, vocab, (c,), generator=rng).tolist()) for r in rids])
        times = []
        for rep in range(repeats + 1):
            trees = [Tree(r, torch.randint(1, vocab, (k,), generator=rng).tolist(), [-1] + list(range(k - 1)))
                     for r in rids]
            t0 = time.perf_counter()
            runner.forward(trees)
            ms = (time.perf_counter() - t0) * 1e3
            for r in rids:
                runner.discard_tree(r)
            if rep:
                times.append(ms)
        for r in rids:
            runner.release(r)
        points.append({"requests": n, "tokens": n * k, "context": n * c, "pairs": n * k * c,
                       "ms": statistics.median(times)})
    for t, c in chunks:  # a prefill chunk of t tokens after c tokens of the same prompt
        times = []
        for rep in range(repeats + 1):
            if c:
                runner.forward([Chunk("chunk", torch.randint(1, vocab, (c,), generator=rng).tolist())])
            t0 = time.perf_counter()
            runner.forward([Chunk("chunk", torch.randint(1, vocab, (t,), generator=rng).tolist(), logits_at=[t - 1])])
            ms = (time.perf_counter() - t0) * 1e3
            runner.release("chunk")
            if rep:
                times.append(ms)
        points.append({"requests": 1, "tokens": t, "context": c, "pairs": t * c, "ms": statistics.median(times)})
    return points


def hat(t: float, knots: tuple[int, ...]) -> list[float]:
    row = [0.0] * len(knots)
    if t <= knots[0]:
        row[0] = 1.0
        return row
    for i in range(1, len(knots)):
        if t <= knots[i] or i == len(knots) - 1:
            f = (t - knots[i - 1]) / (knots[i] - knots[i - 1])
            row[i - 1], row[i] = 1 - f, f
            return row
    return row


def fit(points: list[dict]) -> LatencyModel:
    knots = tuple(k for k in KNOTS if k <= max(p["tokens"] for p in points))
    a = np.array([hat(p["tokens"], knots) + [p["requests"], p["context"] / 1e3, p["pairs"] / 1e6] for p in points])
    y = np.array([p["ms"] for p in points])
    # relative error: weight each point by 1 / its time
    w = 1 / y
    coef = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0]
    coef[-3:] = np.maximum(coef[-3:], 0)  # a negative per-request, -context or -pair time is noise: drop it
    if min(coef[-3:]) == 0:
        keep = [i for i in range(a.shape[1]) if i < len(knots) or coef[i] > 0]
        sub = np.linalg.lstsq((a * w[:, None])[:, keep], y * w, rcond=None)[0]
        coef = np.zeros(a.shape[1])
        coef[keep] = sub
    table = [round(float(v), 3) for v in coef[: len(knots)]]
    return LatencyModel(knots, tuple(table), round(float(coef[-3]), 4), round(float(coef[-2]), 4),
                        round(float(coef[-1]), 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/sim_fit_latency.json"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = Path(__file__).resolve().parent.parent / "models"
    result: dict = {"threads": 1, "repeats": args.repeats, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    grids = {
        "target": [(n, k, c) for n in (1, 2, 4, 8, 16, 32) for k in (1, 2, 4, 8) for c in (32, 256)],
        "draft": [(n, k, c) for n in (1, 4, 16, 32, 64) for k in (1, 2, 4) for c in (32, 256)],
    }
    for name in ("target", "draft"):
        points = measure(models / name, grids[name], [(16, 0), (64, 0), (256, 0), (256, 256), (256, 768), (128, 1024)],
                         args.repeats)
        model = fit(points)
        for p in points:
            n = p["requests"]
            p["model_ms"] = round(model.pass_ms([(p["tokens"] // n, p["context"] // n)] * n), 3)
            p["error"] = round(p["model_ms"] / p["ms"] - 1, 3)
        errors = sorted(abs(p["error"]) for p in points)
        result[name] = {"tokens": list(model.tokens), "ms": list(model.ms), "per_request_ms": model.per_request_ms,
                        "per_context_token_us": model.per_context_token_us, "per_pair_ns": model.per_pair_ns,
                        "median_abs_error": errors[len(errors) // 2], "max_abs_error": errors[-1], "points": points}
        print(name, {k: v for k, v in result[name].items() if k != "points"}, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
