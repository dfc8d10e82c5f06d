"""Fit the simulation's acceptance model (shared/simulate/acceptance.py) to the bundled pair's
measured acceptance: models/report.json, written by training/evaluate.py (greedy speculation on
64 held-out prompts, every candidate node verified; chains k = 1..8 and beam trees (d, w)).

    python bench/sim_fit_acceptance.py [--report models/report.json] [--out bench/results/sim_fit_acceptance.json]

Chains fix alpha: a chain of k accepts 1 + sum_{j<=k} prod_{i<=j} alpha_i tokens per step in
expectation. The fitted form is alpha = (a1, a2, r, r, ...) by least squares over k = 1..8. Beam
trees then fix the rank tail beta and the concentration kappa (grid search; expected tokens per
step of a (d, w) tree = 1 + the mean sum of its nodes' path probabilities, which the model makes
exact, over 4000 sampled trees per point).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
from pathlib import Path

from specserve.shared.simulate.acceptance import AcceptanceModel


def chain_tokens(alpha: list[float], k: int) -> float:
    total, survive = 1.0, 1.0
    for j in range(k):
        survive *= alpha[min(j, len(alpha) - 1)]
        total += survive
    return total


def tree_tokens(model: AcceptanceModel, d: int, w: int, samples: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    truth = list(range(10, 10 + d))

    def wrong(k: int, node: int, count: int) -> list[int]:
        return [1000 + k * 100 + i for i in range(count)]

    sums = []
    for _ in range(samples):
        _, _, probs = model.propose(rng, truth, wrong, d, w, 1)
        sums.append(sum(probs[1:]))
    return 1 + statistics.fmean(sums)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=Path("models/report.json"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/sim_fit_acceptance.json"))
    parser.add_argument("--samples", type=int, default=4000)
    args = parser.parse_args()
    acc = json.loads(args.report.read_text())["evaluate"]["acceptance"]
    chains = {int(k): v for k, v in acc["chain_tokens_per_step"].items()}
    trees = {(t["depth"], t["width"]): t["tokens_per_step"] for t in acc["beam_trees"].values()}
    grid = [i / 100 for i in range(30, 96)]
    best = min(itertools.product(grid, grid, grid),
               key=lambda p: sum((chain_tokens([p[0], p[1], p[2]], k) - v) ** 2 for k, v in chains.items()))
    alpha = [round(a, 2) for a in best]
    fits = []
    for beta, kappa in itertools.product([0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9], [2.0, 4.0, 8.0, 16.0, 32.0]):
        model = AcceptanceModel(tuple(alpha), beta, kappa)
        predicted = {dw: tree_tokens(model, *dw, args.samples // 4) for dw in trees}
        err = sum((predicted[dw] - v) ** 2 for dw, v in trees.items())
        fits.append((err, beta, kappa))
    _, beta, kappa = min(fits)
    model = AcceptanceModel(tuple(alpha), beta, kappa)
    result = {
        "source": str(args.report),
        "depth_accept": alpha, "rank_tail": beta, "concentration": kappa,
        "chains": {k: {"measured": v, "model": round(chain_tokens(alpha, k), 3)} for k, v in chains.items()},
        "trees": {f"d{d}w{w}": {"measured": v, "model": round(tree_tokens(model, d, w, args.samples), 3)}
                  for (d, w), v in trees.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
