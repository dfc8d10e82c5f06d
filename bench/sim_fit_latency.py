"""Fit the simulation's latency model (shared/simulate/latency.py) to measured passes of the
bundled target and draft, in process, one torch thread (as `specserve up` runs each service on
2 cores).

    .venv/bin/python bench/sim_fit_latency.py [--out bench/results/sim_fit_latency.json]

The passes: a grid of n requests x k tree nodes at context c (every request prefilled to c tokens
first, untimed; the tree is discarded after the call so the context stays c), single prefill
chunks, decodes of unequal context and mixed passes (a prefill chunk beside decodes), as the
serving stack makes them. Median of --repeats timed calls after one warm-up. The model
    pass_ms = table(T) + per_request_ms * n + per_context_token_us / 1000 * C + per_pair_ns / 1e6 * P
with C and P the context and (new token, context token) pairs as the padded attention counts them
(shared/simulate/latency.py: padded_attention, as this project's attention runs) is linear in its
parameters (the table's values at fixed knots are the coefficients of hat
functions), so it is fitted by least squares (relative error; negative linear terms are dropped);
the report gives each point's measured and fitted time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.simulate.latency import LatencyModel

KNOTS = (1, 2, 8, 16, 32, 64, 128, 256, 512)


def measure(model_dir: Path | None, passes: list[list[tuple[str, int, int]]], repeats: int,
            runner: ModelRunner | None = None, sync: Callable[[], None] = lambda: None) -> list[dict]:
    """passes: per pass, its entries as (kind, new tokens, context): kind "T" a chain tree of that many
    nodes (a decode when 1), "C" a prefill chunk. Each entry's context is prefilled first (untimed);
    after each timed call the trees are discarded and the chunks truncated, so the context stays.
    runner: the one to time (default: `model_dir`'s on CPU); sync: waits for the device's queued work."""
    if runner is None:
        assert model_dir is not None
        runner = ModelRunner.from_dir(model_dir, num_blocks=4096)
    rng = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=rng).tolist()

    points = []
    for p, entries in enumerate(passes):
        rids = [f"p{p}-{i}" for i in range(len(entries))]
        runner.forward([Chunk(r, tokens(c)) for r, (_, _, c) in zip(rids, entries) if c])
        times = []
        for rep in range(repeats + 1):
            batch = [Tree(r, tokens(n), [-1] + list(range(n - 1))) if kind == "T"
                     else Chunk(r, tokens(n), logits_at=[n - 1]) for r, (kind, n, _) in zip(rids, entries)]
            sync()
            t0 = time.perf_counter()
            runner.forward(batch)
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            for r, (kind, _, c) in zip(rids, entries):
                if kind == "T":
                    runner.discard_tree(r)
                elif c:
                    runner.truncate(r, c)
                else:
                    runner.release(r)
            if rep:
                times.append(ms)
        for r in rids:
            if runner.has_request(r):
                runner.release(r)
        points.append({"entries": [list(e) for e in entries], "ms": statistics.median(times)})
    return points


def grid(ns: tuple[int, ...], ks: tuple[int, ...], cs: tuple[int, ...]) -> list[list[tuple[str, int, int]]]:
    """n equal requests, each verifying a chain of k nodes at context c."""
    return [[("T", k, c)] * n for c in cs for n in ns for k in ks]


CHUNKS = [[("C", t, c)] for t, c in ((16, 0), (64, 0), (256, 0), (256, 256), (256, 768), (128, 1024))]
# Passes the serving stack makes and a uniform grid does not: decodes of unequal context (one long
# prompt among short ones: the padded attention reads the longest for all) and mixed passes, a
# prefill chunk beside decodes (the chunk and the decodes are separate attention groups).
UNEVEN = [[("T", 1, 1024)] + [("T", 1, 64)] * (n - 1) for n in (4, 8, 16)] + [
    [("T", 1, 1536)] * 2 + [("T", 1, 300)] * 14,
    [("T", 4, 1024)] + [("T", 4, 128)] * 7]
MIXED = [[("C", 256, 0)] + [("T", 1, 256)] * 8, [("C", 256, 512)] + [("T", 1, 300)] * 15,
         [("C", 64, 0)] + [("T", 1, 64)] * 8, [("C", 128, 256)] + [("T", 4, 128)] * 8,
         [("C", 256, 0)] + [("T", 1, 1024)] * 4 + [("T", 1, 200)] * 4]


def features(p: dict, knots: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The model's counts for a measured pass (padded attention: this project's attention pads)."""
    model = LatencyModel(knots, (0.0,) * len(knots), padded_attention=True)
    return model.features([(n, c) for _, n, c in p["entries"]])


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
    knots = tuple(k for k in KNOTS if k <= max(features(p, KNOTS)[0] for p in points))
    feats = [features(p, knots) for p in points]
    a = np.array([hat(t, knots) + [n, c / 1e3, pairs / 1e6] for t, n, c, pairs in feats])
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
    table = [round(max(float(v), 0.0), 3) for v in coef[: len(knots)]]  # a negative knot is a few points' noise
    return LatencyModel(knots, tuple(table), round(float(coef[-3]), 4), round(float(coef[-2]), 4),
                        round(float(coef[-1]), 4), padded_attention=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/sim_fit_latency.json"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = Path(__file__).resolve().parent.parent / "models"
    result: dict = {"threads": 1, "repeats": args.repeats, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    sets = {
        "target": {"grid": grid((1, 2, 4, 8, 16, 32), (1, 2, 4, 8), (32, 256)) + grid((1, 4, 16), (1, 4), (1024,)),
                   "chunks": CHUNKS, "uneven": UNEVEN, "mixed": MIXED},
        "draft": {"grid": grid((1, 4, 16, 32, 64), (1, 2, 4), (32, 256)), "chunks": CHUNKS},
    }
    for name in ("target", "draft"):
        labels = [label for label, passes in sets[name].items() for _ in passes]
        points = measure(models / name, [p for passes in sets[name].values() for p in passes], args.repeats)
        model = fit(points)
        for label, p in zip(labels, points):
            p["set"] = label
            p["model_ms"] = round(model.pass_ms([(n, c) for _, n, c in p["entries"]]), 3)
            p["error"] = round(p["model_ms"] / p["ms"] - 1, 3)
        errors = sorted(abs(p["error"]) for p in points)
        by_set = {label: statistics.median(abs(p["error"]) for p in points if p["set"] == label)
                  for label in sets[name]}
        result[name] = {"tokens": list(model.tokens), "ms": list(model.ms), "per_request_ms": model.per_request_ms,
                        "per_context_token_us": model.per_context_token_us, "per_pair_ns": model.per_pair_ns,
                        "padded_attention": True, "load_average": os.getloadavg(),
                        "median_abs_error": errors[len(errors) // 2], "max_abs_error": errors[-1],
                        "median_abs_error_by_set": by_set, "points": points}
        print(name, {k: v for k, v in result[name].items() if k != "points"}, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
