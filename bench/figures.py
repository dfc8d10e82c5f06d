"""Figures for docs/benchmarks.md made from result files already in bench/results/ (nothing is run).

    .venv/bin/python bench/figures.py            # writes docs/figures/speed-vs-transformers.png

speed-vs-transformers.png (real CPU, measured): tokens/s of specserve and of the references as a ratio to
transformers `generate` at one request (left) and to transformers' batched `generate` at 16 requests at
once (right), each ratio taken within a round and shown as the median over rounds with its min-max. From
bench/results/peer_side_by_side_default.json (the bundled demo pair), smollm2_c1.json (SmolLM2-135M-Instruct,
n-gram draft, chat and edit prompts, and llama.cpp on the same Q4_1 file) and smollm2_batch.json; the lab notes
are docs/lab/peer_side_by_side.md, smollm2_c1.md and smollm2_batch.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import load_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _load(name: str) -> dict:
    return load_result(RESULTS / name)


def _within_rounds(rounds: list[dict], key: str, ref: str) -> tuple[float, float, float]:
    """Median, min and max over rounds of key's tokens/s over ref's in the same round."""
    ratios = [r[key]["tokens_per_s"] / r[ref]["tokens_per_s"] for r in rounds]
    return statistics.median(ratios), min(ratios), max(ratios)


def _summary(agg: dict) -> tuple[float, float, float]:
    return agg["median"], agg["min"], agg["max"]


def speed_rows() -> tuple[list[tuple[str, tuple[float, float, float], bool]], list]:
    """(label, (median, min, max), is specserve) rows for the two panels."""
    demo = _load("peer_side_by_side_default.json")["rounds"]
    smol = _load("smollm2_c1.json")["summary"]
    batch = _load("smollm2_batch.json")["summary"]
    one = [
        ("demo pair: none (torch pass)", _within_rounds(demo, "specserve none", "transformers generate"), True),
        ("demo pair: joint (torch pass)", _within_rounds(demo, "specserve joint", "transformers generate"), True),
        ("demo pair: HF assisted", _within_rounds(demo, "transformers assisted", "transformers generate"), False),
        ("SmolLM2 chat: none", _summary(smol["chat/none"]["vs_hf_generate"]), True),
        ("SmolLM2 chat: joint (default)", _summary(smol["chat/joint"]["vs_hf_generate"]), True),
        ("SmolLM2 chat: HF prompt lookup", _summary(smol["chat/hf_prompt_lookup"]["vs_hf_generate"]), False),
        ("SmolLM2 edit: none", _summary(smol["edit/none"]["vs_hf_generate"]), True),
        ("SmolLM2 edit: joint (default)", _summary(smol["edit/joint"]["vs_hf_generate"]), True),
        ("SmolLM2 edit: adaserve", _summary(smol["edit/adaserve"]["vs_hf_generate"]), True),
        ("SmolLM2 edit: HF prompt lookup", _summary(smol["edit/hf_prompt_lookup"]["vs_hf_generate"]), False),
        ("SmolLM2 chat: llama.cpp, same file", _summary(smol["chat/llama_cpp"]["vs_hf_generate"]), False),
        ("SmolLM2 edit: llama.cpp, same file", _summary(smol["edit/llama_cpp"]["vs_hf_generate"]), False),
    ]
    sixteen = [
        ("demo pair: none (torch pass)", _within_rounds(demo, "specserve none, 16 at once",
                                           "transformers batched generate, batch 16"), True),
        ("demo pair: joint (torch pass)", _within_rounds(demo, "specserve joint, 16 at once",
                                                      "transformers batched generate, batch 16"), True),
        ("SmolLM2: none", _summary(batch["none"]["vs_hf_batched"]), True),
        ("SmolLM2: joint (default)", _summary(batch["joint"]["vs_hf_batched"]), True),
    ]
    return one, sixteen


def plot_speed(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one, sixteen = speed_rows()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    for ax, rows, ref in ((axes[0], one, "transformers generate, 1 request"),
                          (axes[1], sixteen, "transformers batched generate, 16 at once")):
        labels = [r[0] for r in rows][::-1]
        med = [r[1][0] for r in rows][::-1]
        err = [[r[1][0] - r[1][1] for r in rows][::-1], [r[1][2] - r[1][0] for r in rows][::-1]]
        colors = ["tab:blue" if r[2] else "tab:gray" for r in rows][::-1]
        ax.barh(range(len(rows)), med, xerr=err, color=colors, capsize=3)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.set_xlabel(f"tokens/s over {ref}\n(ratio within each round: median of 3 rounds, min-max)", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_title("one request at a time", fontsize=10)
    axes[1].set_title("16 requests at once", fontsize=10)
    fig.suptitle("real CPU (measured, 2 cores, float32, one thread per process): specserve (blue) and "
                 "references (gray) against transformers", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fig-dir", default=str(ROOT / "docs" / "figures"))
    args = ap.parse_args(argv)
    print(plot_speed(Path(args.fig_dir) / "speed-vs-transformers.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
