"""The default policy's regression guard: the default (`joint@slo`) against every other policy on the
SIMULATED 7B and 70B presets, on two SLO mixes no other benchmark uses, with fresh seeds.

    .venv/bin/python bench/policy_guard.py                    # 2 presets x 2 mixes, 1 run (about 30 min)
    .venv/bin/python bench/policy_guard.py --runs 3 --min-requests 100 --duration-s 25   # the full bar
    .venv/bin/python bench/policy_guard.py --presets 7b --mixes agents --check   # one cell; exit 1 on a loss
    .venv/bin/python bench/policy_guard.py --seed 41207       # the same draw again

For each preset the target is profiled once (`specserve profile` on the simulated target); each mix's
TPOT targets are multiples of that profile's baseline iteration (so one mix means the same on either
preset); then bench/sweep.py runs every policy at the preset's rates with the seed (printed; fresh
from the clock unless given), each policy on fresh services, and bench/paper_ratio.py reads the result:

- **the envelope**: at each rate the default's median attainment and goodput over the best other
  policy's (SLO-admission and FIFO policies alike);
- **the cliff ratio**: the default's attainment and goodput over the best FIFO policy's at the rate
  where that one meets 50 % (AdaServe's headline ratio, interpolated between rates).

A request is met only when both its TTFT and its TPOT are (the load generator's rule). `--check` exits
1 when the default is under `--min-envelope` (0.98) of the best policy at any rate, or under
`--min-cliff` (1.5) of the best FIFO policy at its 50 % rate; one run is noisy, so a loss there is
read again with `--runs 3` before it is believed. Writes bench/results/policy_guard.json (settings, seed,
every envelope and cliff row) and keeps each sweep in bench/results/sweep-guard-<preset>-<mix>/.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import lzma
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import msgspec  # noqa: E402
import paper_ratio  # noqa: E402
import sweep  # noqa: E402

from specserve.cli.loadgen.records import RequestRecord  # noqa: E402

DEFAULT = "joint@slo"
# Every policy the default should not trail: the single policies under the same SLO admission, and the
# FIFO baselines (the best of which sets the cliff).
SLO_POLICIES = ("slo-goodput@slo", "chain:5@slo", "adaserve@slo")
FIFO_POLICIES = ("none", "chain:3", "nightjar")
# Preset, its time scale (the CPU's gateway must keep up with the simulated pass), and its default rates. On
# these mixes the best FIFO policy (`none`) can stay above 50 % at the top rate (the cliff ratio is then taken
# there and flagged "above"): `--rates` takes them higher.
PRESETS = {
    "7b": ("llama2-7b-a100,time_scale=4", (3.0, 5.0, 8.0)),
    "70b": ("llama2-70b-4xa100,time_scale=2", (2.0, 4.0, 6.0)),
}
# TIER=SHARE:PROMPTS:TPOT as a multiple of the preset's baseline iteration; unlike bench/sweep.py's mix
# (60 % critical at 1x on short prompts) and bench/admission.py's.
MIXES = {
    "agents": "critical=0.3:medium:1.3,search=0.5:short:3,chat=0.2:long:6",
    "long-chat": "critical=0.15:long:1.6,search=0.25:medium:2.2,chat=0.6:short:12",
}
RESULT = ROOT / "bench" / "results" / "policy_guard.json"


def mix_in_ms(mix: str, baseline_ms: float) -> str:
    """`mix` with each TPOT multiple turned into milliseconds of this profile."""
    parts = []
    for part in mix.split(","):
        tier, _, rest = part.partition("=")
        share, prompts, mult = rest.split(":")
        parts.append(f"{tier}={share}:{prompts}:{float(mult) * baseline_ms:.1f}")
    return ",".join(parts)


def run_cell(preset: str, mix_name: str, profile: Path, baseline_ms: float, args: argparse.Namespace) -> dict:
    """One sweep of every policy on one preset and mix; its envelope and cliff ratio."""
    simulate, rates = PRESETS[preset]
    name = f"guard-{preset}-{mix_name}"
    out_dir = args.out.parent / f"sweep-{name}"
    argv = ["--simulate", simulate, "--profile", str(profile), "--name", name, "--out-dir", str(out_dir), "--docs", "",
            "--fig-dir", args.fig_dir, "--mix", mix_in_ms(MIXES[mix_name], baseline_ms),
            "--policies", ";".join((DEFAULT, *args.others)), "--chain-ks", "5",
            "--rates", ",".join(f"{r:g}" for r in (args.rates or rates)), "--runs", str(args.runs),
            "--duration-s", str(args.duration_s), "--min-requests", str(args.min_requests),
            "--solo-requests", "1", "--seed", str(args.seed)]
    with contextlib.redirect_stdout(io.StringIO()):  # the sweep's own report: this prints the guard's
        status = sweep.main(argv)
    if status != 0:
        raise RuntimeError(f"the sweep of {name} failed")
    plain = out_dir / "sweep.json"
    results = sweep.load_result(plain)
    (out_dir / "sweep.json.xz").write_bytes(lzma.compress(plain.read_bytes()))
    plain.unlink()
    rows = paper_ratio.envelope(results, DEFAULT)
    cliff = paper_ratio.ratios(results, [DEFAULT], tuple(p for p in args.others if "@" not in p))
    trailing = {row["rate"]: sorted({row[k]["best"] for k in ("attainment", "goodput")
                                     if row[k]["ratio"] is not None and row[k]["ratio"] < args.min_envelope})
                for row in rows}
    breakdowns = {f"{rate:g}": why(out_dir, [DEFAULT, *winners], rate, args.runs)
                  for rate, winners in trailing.items() if winners}
    for rate, breakdown in breakdowns.items():
        print(f"\n{name}: {why_markdown(float(rate), breakdown)}", file=sys.stderr)
    return {"preset": simulate, "mix": MIXES[mix_name], "mix_ms": mix_in_ms(MIXES[mix_name], baseline_ms),
            "envelope": rows, "cliff": cliff, "why": breakdowns,
            "sweep": os.path.relpath(out_dir / "sweep.json.xz", ROOT)}


def tiers(records: list[RequestRecord]) -> dict[str, dict]:
    """Per SLO tier, what became of its requests: refused (503), served best effort, TTFT or TPOT missed
    among those served, both met; and the tokens per verify step of the served ones."""
    out = {}
    for tier in sorted({r.category for r in records}):
        mine = [r for r in records if r.category == tier]
        served = [r for r in mine if r.ok]
        steps = sum(r.steps for r in served)
        out[tier] = {"requests": len(mine), "refused": sum(r.status == 503 for r in mine),
                     "best_effort": sum(r.best_effort for r in served),
                     "ttft_missed": sum(not r.ttft_met for r in served),
                     "tpot_missed": sum(not r.tpot_met for r in served), "met": sum(r.slo_met for r in mine),
                     "tokens_per_step": round(sum(r.step_tokens for r in served) / steps, 2) if steps else None}
    return out


def why(out_dir: Path, policies: list[str], rate: float, runs: int) -> dict[str, dict]:
    """`tiers` of each policy's requests at one rate, over its runs (the sweep's per-request JSONL)."""
    decoder = msgspec.json.Decoder(RequestRecord)
    result = {}
    for policy in policies:
        records = [decoder.decode(line) for run in range(runs)
                   for path in [out_dir / f"{sweep.slug(policy)}-rate{rate:g}-run{run}.jsonl"] if path.is_file()
                   for line in path.read_bytes().splitlines() if line.strip()]
        result[policy] = tiers(records)
    return result


def why_markdown(rate: float, breakdown: dict[str, dict]) -> str:
    lines = [f"At {rate:g} req/s, per tier: requests, refused, best effort, TTFT missed, TPOT missed, met, "
             "tokens per step", "", "| policy | " + " | ".join(next(iter(breakdown.values()))) + " |",
             "|---|" + "---|" * len(next(iter(breakdown.values())))]
    for policy, by_tier in breakdown.items():
        lines.append(f"| {policy} | " + " | ".join(
            f"{t['requests']}, {t['refused']}, {t['best_effort']}, {t['ttft_missed']}, {t['tpot_missed']}, "
            f"**{t['met']}**, {t['tokens_per_step']}" for t in by_tier.values()) + " |")
    return "\n".join(lines)


def verdicts(cell: dict, min_envelope: float, min_cliff: float) -> list[str]:
    """What breaks the guard's bar in one cell (empty when nothing does)."""
    broken = []
    for row in cell["envelope"]:
        for key in ("attainment", "goodput"):
            ratio = row[key]["ratio"]
            if ratio is not None and ratio < min_envelope:
                broken.append(f"{key} at {row['rate']:g} req/s: {ratio:.2f}x {row[key]['best']}")
    c = cell["cliff"]["policies"][DEFAULT]
    for key in ("attainment_ratio", "goodput_ratio"):
        if c[key] is not None and c[key] < min_cliff:
            broken.append(f"cliff {key.split('_')[0]}: {c[key]:.2f}x {cell['cliff']['best_baseline']} at "
                          f"{cell['cliff']['rate']:g} req/s")
    return broken


def summary(cells: dict[str, dict], min_envelope: float, min_cliff: float) -> str:
    lines = ["| preset, mix | default / best other, attainment (worst rate) | goodput (worst rate) "
             "| cliff: best FIFO, its 50 % rate | default / it, attainment | goodput | verdict |",
             "|---|---:|---:|---|---:|---:|---|"]
    for key, cell in cells.items():
        worst = {k: min((r for r in cell["envelope"] if r[k]["ratio"] is not None), key=lambda r: r[k]["ratio"])
                 for k in ("attainment", "goodput")}
        c, p = cell["cliff"], cell["cliff"]["policies"][DEFAULT]
        flag = f" ({c['flag']})" if c["flag"] else ""
        broken = verdicts(cell, min_envelope, min_cliff)
        lines.append(
            f"| {key} | " + " | ".join(f"{worst[k][k]['ratio']:.2f}x ({worst[k]['rate']:g}, {worst[k][k]['best']})"
                                       for k in ("attainment", "goodput"))
            + f" | {c['best_baseline']}, {c['rate']:g} req/s{flag} | {p['attainment_ratio'] or 0:.2f}x | "
            f"{p['goodput_ratio'] or 0:.2f}x | {'; '.join(broken) or 'holds'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated, of {', '.join(PRESETS)}")
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, of {', '.join(MIXES)}")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="request rates for every preset (default: each preset's own)")
    ap.add_argument("--policies", default=";".join((*SLO_POLICIES, *FIFO_POLICIES)),
                    help="';'-separated, the policies the default is held against (a name without @: FIFO admission, "
                         "a baseline of the cliff ratio)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--duration-s", type=float, default=6.0, help="seconds of arrivals per load point")
    ap.add_argument("--min-requests", type=int, default=30, help="fewest requests per load point")
    ap.add_argument("--seed", type=int, default=None, help="the draw (default: fresh, from the clock)")
    ap.add_argument("--check", action="store_true", help="exit 1 when the default breaks the bar anywhere")
    ap.add_argument("--min-envelope", type=float, default=0.98)
    ap.add_argument("--min-cliff", type=float, default=1.5)
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    args.seed = int(time.time()) % 100_000 if args.seed is None else args.seed
    args.fig_dir = tempfile.mkdtemp(prefix="policy-guard-figures-")  # the sweeps' figures: not kept
    presets, mixes, args.others = args.presets.split(","), args.mixes.split(","), args.policies.split(";")
    if not any("@" not in p for p in args.others):
        ap.error("--policies needs at least one FIFO policy (a name without @): the cliff ratio's baseline")
    unknown = [p for p in presets if p not in PRESETS] + [m for m in mixes if m not in MIXES]
    if unknown:
        ap.error(f"unknown preset or mix: {', '.join(unknown)}")
    print(f"policy guard: seed {args.seed}, {len(presets) * len(mixes)} sweeps", file=sys.stderr, flush=True)
    t0, cells = time.time(), {}
    for preset in presets:
        profile = args.out.parent / f"sweep-guard-{preset}-profile.json"
        baseline = sweep.measure_profile(profile, 1, False, PRESETS[preset][0])["baseline_iteration_ms"]
        for mix in mixes:
            cells[f"{preset}, {mix}"] = run_cell(preset, mix, profile, baseline, args)
    table = summary(cells, args.min_envelope, args.min_cliff)
    broken = [b for cell in cells.values() for b in verdicts(cell, args.min_envelope, args.min_cliff)]
    record = {"meta": sweep.machine_info() | {"wall_s": round(time.time() - t0, 1), "simulated": True},
              "settings": {"seed": args.seed, "runs": args.runs, "duration_s": args.duration_s,
                           "min_requests": args.min_requests, "default": DEFAULT,
                           "policies": args.others},
              "cells": cells, "table": table, "broken": broken}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nSIMULATED (presets {', '.join(PRESETS[p][0] for p in presets)}), seed {args.seed}, "
          f"{args.runs} run(s), {time.time() - t0:.0f} s\n\n{table}\n\nresults: {args.out}")
    return 1 if args.check and broken else 0


if __name__ == "__main__":
    sys.exit(main())
