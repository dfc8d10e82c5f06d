"""What the load generator sends: a category mix over the workload prompt sets.

A category is an SLO class (the `service_tier` sent on each request), its share of the requests,
and the prompt set its prompts come from. The default mix is AdaServe's (Table 2, Fig. 4): 60%
latency-critical requests on short prompts, 20% search-like requests on long prompts and 20% chat
on short prompts. A category may also carry an explicit TPOT target, sent as `slo.tpot_ms`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = Path(__file__).resolve().parents[3] / "bench" / "workloads"
DEFAULT_MIX = "critical=0.6:short,search=0.2:long,chat=0.2:short"


@dataclass(frozen=True, slots=True)
class Category:
    tier: str  # the SLO class, sent as service_tier
    share: float  # fraction of the requests, 0..1 (normalized over the mix)
    workload: str  # prompt set: bench/workloads/<workload>.jsonl, or a path to a JSONL file
    tpot_ms: float | None = None  # explicit TPOT SLO sent as slo.tpot_ms (None: the class's own)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    index: int  # position in the run (also the arrival order)
    category: str  # the tier
    workload: str
    prompt_id: str
    prompt: str
    max_tokens: int
    tpot_ms: float | None  # explicit SLO override, if the category has one


def parse_mix(spec: str) -> list[Category]:
    """'critical=0.6:short,search=0.2:long,chat=0.2:short[:TPOT_MS]' -> categories."""
    cats = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        tier, eq, rest = part.partition("=")
        fields = rest.split(":")
        try:
            if not eq or not tier.strip() or len(fields) not in (2, 3):
                raise ValueError
            share = float(fields[0])
            tpot = float(fields[2]) if len(fields) == 3 else None
        except ValueError:
            raise ValueError(f"bad category {part!r}: expected TIER=SHARE:WORKLOAD[:TPOT_MS], "
                             "e.g. critical=0.6:short") from None
        if share < 0 or (tpot is not None and tpot <= 0):
            raise ValueError(f"bad category {part!r}: the share must be >= 0 and the TPOT > 0")
        cats.append(Category(tier.strip(), share, fields[1].strip(), tpot))
    if not cats or sum(c.share for c in cats) <= 0:
        raise ValueError(f"the mix {spec!r} has no category with a positive share")
    if len({c.tier for c in cats}) != len(cats):
        raise ValueError(f"the mix {spec!r} names a tier twice")
    return cats


def load_prompts(workload: str) -> list[dict]:
    """Rows of a prompt set: {id, prompt, max_tokens, ...}."""
    path = Path(workload) if workload.endswith(".jsonl") else WORKLOADS / f"{workload}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in WORKLOADS.glob("*.jsonl"))
        raise ValueError(f"no prompt set {workload!r} (known: {', '.join(known)}, or a path to a .jsonl file)")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: a row needs a string 'prompt'")
        row.setdefault("id", f"{path.stem}-{lineno}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def counts_for(categories: list[Category], n: int) -> list[int]:
    """Exact request counts per category: shares of n, rounded by largest remainder."""
    total = sum(c.share for c in categories)
    raw = [n * c.share / total for c in categories]
    counts = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: (raw[i] - counts[i], -i), reverse=True)
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def build_requests(categories: list[Category], n: int, seed: int = 0, max_tokens: int | None = None,
                   prompts: dict[str, list[dict]] | None = None, sequential: bool = False) -> list[BenchRequest]:
    """`n` requests with each category's exact share, in a seeded random order; prompts drawn at random
    (seeded) from each category's set, or with `sequential` in the set's own order (cycling); max_tokens
    from the prompt row unless given."""
    rng = random.Random(seed)
    prompts = prompts or {}
    for c in categories:
        if c.workload not in prompts:
            prompts[c.workload] = load_prompts(c.workload)
    tiers = [c for c, k in zip(categories, counts_for(categories, n)) for _ in range(k)]
    rng.shuffle(tiers)
    out = []
    taken = dict.fromkeys(prompts, 0)
    for i, c in enumerate(tiers):
        rows = prompts[c.workload]
        if sequential:
            row = rows[taken[c.workload] % len(rows)]
            taken[c.workload] += 1
        else:
            row = rng.choice(rows)
        mt = max_tokens if max_tokens is not None else int(row.get("max_tokens", 128))
        out.append(BenchRequest(i, c.tier, c.workload, str(row["id"]), row["prompt"], mt, c.tpot_ms))
    return out
