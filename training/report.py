"""Render models/report.json as the measured-figures section of models/README.md."""

from __future__ import annotations

import json
from pathlib import Path

BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"


def _fmt_s(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"


def _alpha(tokens_per_step: float, k: int) -> float:
    """Per-token acceptance rate a with (1 - a^(k+1)) / (1 - a) = tokens_per_step, by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return lo


def render(r: dict) -> str:
    hw, t, d = r["hardware"], r["target"], r["draft"]
    ev = r["evaluate"]
    held, cost, acc, greedy = ev["heldout"], ev["forward_cost"], ev["acceptance"], ev["target_greedy"]
    out = [
        f"Measured on {hw['cpu']}, {hw['threads']} threads, torch {hw['torch']}, Python {hw['python']}.",
        "",
        "| | target | draft |",
        "|---|---|---|",
        f"| parameters | {t['parameters'] / 1e6:.2f}M | {d['parameters'] / 1e6:.2f}M "
        f"({t['parameters'] / d['parameters']:.1f}x fewer) |",
        f"| layers x hidden (heads / kv heads) | {t['config']['num_hidden_layers']} x {t['config']['hidden_size']} "
        f"({t['config']['num_attention_heads']}/{t['config']['num_key_value_heads']}) | "
        f"{d['config']['num_hidden_layers']} x {d['config']['hidden_size']} "
        f"({d['config']['num_attention_heads']}/{d['config']['num_key_value_heads']}) |",
        "| objective | cross-entropy | KL to the target's next-token distribution |",
        f"| steps / tokens seen | {t['steps']} / {t['train_tokens'] / 1e6:.2f}M | {d['steps']} / "
        f"{d['train_tokens'] / 1e6:.2f}M |",
        f"| training wall time | {_fmt_s(t['wall_s'])} | {_fmt_s(d['wall_s'])} |",
        f"| held-out loss (nats/token, {held['tokens']:,} tokens) | {held['target_loss']:.3f} | "
        f"{held['draft_loss']:.3f} |",
        f"| 1-token decode at {cost['context']} tokens of KV, our runtime, float32 | {cost['target_ms']:.2f} ms | "
        f"{cost['draft_ms']:.2f} ms ({cost['ratio']:.1f}x cheaper) |",
        "",
        f"Top-1 agreement (draft argmax = target argmax, held-out text, teacher-forced): "
        f"**{held['top1_agreement']:.3f}**.",
        "",
        f"Greedy speculation on the first {greedy['prompts']} held-out short prompts, {greedy['new_tokens']} "
        "target tokens each, every candidate node verified. Tokens per step counts the accepted draft "
        "tokens plus the target's bonus token.",
        "",
        "| chain length k | " + " | ".join(acc["chain_tokens_per_step"]) + " |",
        "|---" * (len(acc["chain_tokens_per_step"]) + 1) + "|",
        "| tokens per step | " + " | ".join(f"{v:.2f}" for v in acc["chain_tokens_per_step"].values()) + " |",
        "",
        "| beam tree (depth d, width w) | draft nodes | tokens per step |",
        "|---|---|---|",
    ]
    for tr in acc["beam_trees"].values():
        out.append(f"| d={tr['depth']}, w={tr['width']} | {tr['nodes']} | {tr['tokens_per_step']:.2f} |")
    out += [
        "",
        "Longer prompts, the first few of each set, same method:",
        "",
        "| prompts | count | chain k = 4 | beam d=4, w=4 |",
        "|---|---|---|---|",
        *[f"| {cat} | {v['prompts']} | {v['chain4_tokens_per_step']:.2f} | {v['d4w4_tokens_per_step']:.2f} |"
          for cat, v in acc["other_categories"].items()],
        "",
        f"Chain k = 4 accepts {acc['chain4_accepted_fraction']:.2f} of its draft tokens; under the usual i.i.d. "
        f"model, (1 - a^5) / (1 - a) = {acc['chain_tokens_per_step']['4']:.2f} gives a per-token acceptance rate "
        f"a = {_alpha(acc['chain_tokens_per_step']['4'], 4):.2f}.",
        "",
        f"The target's greedy output: {greedy['distinct_line_ratio_mean']:.2f} of its non-blank lines are distinct "
        "(mean over prompts). It repeats phrases within a line now and then, as small models do; three samples "
        "are in `report.json`.",
    ]
    return "\n".join(out)


def update_readme(report_path: Path, readme_path: Path) -> None:
    text = readme_path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme_path.write_text(f"{head}{BEGIN}\n{render(json.loads(report_path.read_text()))}\n{END}{tail}")
