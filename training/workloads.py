"""Workload prompt sets drawn from held-out files, one JSONL per category.

Each prompt is a run of whole lines ending at a line break, so the model's natural next step is to
write the following line, as in code completion.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from training.corpus import SourceFile


@dataclass(frozen=True)
class Category:
    name: str
    min_tokens: int  # prompt length bounds, tokens
    max_tokens: int
    output_tokens: tuple[int, int]  # suggested max_tokens is drawn uniformly from this range
    count: int
    purpose: str


CATEGORIES = (
    Category("short", 32, 128, (32, 128), 300, "code completion: short prompt, short answer"),
    Category("medium", 200, 500, (64, 256), 300, "chat-like: medium prompt"),
    Category("long", 1000, 2000, (64, 192), 300, "long context: the stand-in for summarization/search"),
)


def _draw(files: list[SourceFile], line_tokens: dict[str, list[int]], cat: Category, rng: random.Random) -> dict:
    while True:
        f = rng.choice(files)
        counts = line_tokens[f.path]
        if sum(counts) < cat.min_tokens:
            continue
        want = rng.randint(cat.min_tokens, cat.max_tokens)
        end = rng.randint(1, len(counts))  # prompt is lines [start, end)
        start, total = end, 0
        while start > 0 and total < want:
            start -= 1
            total += counts[start]
        if cat.min_tokens <= total <= cat.max_tokens:
            return {"path": f.path, "start": start, "end": end}


def write_sets(held_out: list[SourceFile], tokenizer_dir: Path, out_dir: Path, seed: int) -> dict:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    lines = {f.path: f.text.splitlines(keepends=True) for f in held_out}
    # Token counts per line; a prompt's count is then exact up to merges across line breaks,
    # and the final count below is taken on the joined text.
    line_tokens = {p: [len(e.ids) for e in tok.encode_batch(ls, add_special_tokens=False)] if ls else []
                   for p, ls in lines.items()}
    files = [f for f in held_out if line_tokens[f.path]]
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {}
    for cat in CATEGORIES:
        rng = random.Random(f"{seed}-{cat.name}")
        seen, records = set(), []
        while len(records) < cat.count:
            pick = _draw(files, line_tokens, cat, rng)
            text = "".join(lines[pick["path"]][pick["start"]:pick["end"]])
            n = len(tok.encode(text, add_special_tokens=False).ids)
            if text in seen or not cat.min_tokens <= n <= cat.max_tokens:
                continue
            seen.add(text)
            records.append({"id": f"{cat.name}-{len(records):04d}", "category": cat.name, "prompt": text,
                            "prompt_tokens": n, "max_tokens": rng.randint(*cat.output_tokens),
                            "source": f"Lib/{pick['path']}:{pick['start'] + 1}-{pick['end']}"})
        with open(out_dir / f"{cat.name}.jsonl", "w") as fh:
            for r in records:
                fh.write(json.dumps(r) + "\n")
        lens = sorted(r["prompt_tokens"] for r in records)
        summary[cat.name] = {"count": len(records), "prompt_tokens_min": lens[0], "prompt_tokens_median":
                             lens[len(lens) // 2], "prompt_tokens_max": lens[-1], "purpose": cat.purpose,
                             "max_tokens_range": list(cat.output_tokens)}
    return summary
