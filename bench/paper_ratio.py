"""AdaServe's headline ratio from a sweep: a policy's attainment and goodput over the best baseline's,
at the rate where that baseline falls to 50 % attainment (AdaServe Figs. 4-5: up to 1.73x / 1.74x).

    .venv/bin/python bench/paper_ratio.py bench/results/sweep-sim-7b-x4/sweep.json.xz
    .venv/bin/python bench/paper_ratio.py SWEEP_JSON --policies 'adaserve;slo-goodput' --json out.json
    .venv/bin/python bench/paper_ratio.py LOW/sweep.json HIGH/sweep.json   # two sweeps' rates as one
    .venv/bin/python bench/paper_ratio.py SWEEP_JSON --envelope joint   # joint / the best other policy, per rate

Method, on the medians over runs of each (policy, rate) point:
- each baseline's 50 % rate: linear interpolation between the two sweep rates around the first fall
  of its attainment to 50 % or below (the lowest rate if it is below 50 % there already, flagged);
- the best baseline is the one whose 50 % rate is highest (it holds 50 % longest);
- at that rate, every policy's attainment and goodput are interpolated the same way, and divided by
  the baseline's (whose attainment there is 50 % by construction);
- "up to": the largest ratio over the measured rates themselves, as the paper's "up to" reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import SPECINFER_TREE, display, load_result, table  # noqa: E402

BASELINE_PREFIXES = ("none", "chain:", "tree:")  # plain batching, fixed chains, the SpecInfer tree


def interpolate(rates: list[float], values: list[float], at: float) -> float:
    """Piecewise-linear value at `at` (held flat outside the rates)."""
    if at <= rates[0]:
        return values[0]
    for (r0, v0), (r1, v1) in zip(zip(rates, values), zip(rates[1:], values[1:])):
        if at <= r1:
            return v0 + (v1 - v0) * (at - r0) / (r1 - r0)
    return values[-1]


def half_rate(rates: list[float], attainment: list[float]) -> tuple[float, str]:
    """The rate where attainment first falls to 0.5, and a flag: '' (crossed), 'below' (under 0.5 at
    the lowest rate) or 'above' (never fell to 0.5: the highest rate)."""
    if attainment[0] <= 0.5:
        return rates[0], "below"
    for (r0, a0), (r1, a1) in zip(zip(rates, attainment), zip(rates[1:], attainment[1:])):
        if a1 <= 0.5 < a0:
            return r0 + (r1 - r0) * (a0 - 0.5) / (a0 - a1), ""
    return rates[-1], "above"


def ratios(results: dict, policies: list[str] | None = None,
           baseline_prefixes: tuple[str, ...] = BASELINE_PREFIXES) -> dict:
    t = table(results)
    rates = sorted(results["settings"]["rates"])

    def series(policy: str, key: str) -> list[float]:
        return [(t[policy][r][key] or {"median": 0.0})["median"] for r in rates]

    baselines = [p for p in results["policies"] if p.startswith(baseline_prefixes)]
    if not baselines:
        raise SystemExit("error: the sweep has no baseline policy (none, chain:K or tree:...)")
    halves = {b: half_rate(rates, series(b, "attainment")) for b in baselines}
    best = max(baselines, key=lambda b: halves[b][0])
    at, flag = halves[best]
    base_att = interpolate(rates, series(best, "attainment"), at)
    base_good = interpolate(rates, series(best, "goodput_tok_s"), at)
    out = {"simulated": results["meta"].get("simulated"), "rates": rates, "best_baseline": best,
           "half_rates": {display(b): {"rate": round(r, 3), "flag": f} for b, (r, f) in halves.items()},
           "rate": round(at, 3), "flag": flag, "baseline_attainment": base_att, "baseline_goodput": base_good,
           "policies": {}}
    for p in policies or [p for p in results["policies"] if p not in baselines]:
        if p not in t:
            raise SystemExit(f"error: policy {p!r} is not in the sweep ({', '.join(results['policies'])})")
        att, good = series(p, "attainment"), series(p, "goodput_tok_s")
        b_att, b_good = series(best, "attainment"), series(best, "goodput_tok_s")
        a_here, g_here = interpolate(rates, att, at), interpolate(rates, good, at)
        out["policies"][p] = {
            "attainment": a_here, "goodput": g_here,
            "attainment_ratio": a_here / base_att if base_att else None,
            "goodput_ratio": g_here / base_good if base_good else None,
            "up_to_attainment": max((a / b for a, b in zip(att, b_att) if b > 0), default=None),
            "up_to_goodput": max((g / b for g, b in zip(good, b_good) if b > 0), default=None)}
    return out


def merged(sweeps: list[dict]) -> dict:
    """Several sweeps of the same policies (e.g. a second one at higher rates) as one."""
    first = sweeps[0]
    for other in sweeps[1:]:
        if other["policies"] != first["policies"] or other["meta"].get("simulated") != first["meta"].get("simulated"):
            raise SystemExit("error: the sweeps differ in policies or simulated preset; they cannot be merged")
    rates = sorted({r for s in sweeps for r in s["settings"]["rates"]})
    return first | {"settings": first["settings"] | {"rates": rates},
                    "points": [p for s in sweeps for p in s["points"]]}


def envelope(results: dict, policy: str) -> list[dict]:
    """Per rate: `policy`'s median attainment and goodput over the best other policy's (the highest
    median of any other, each metric on its own), with the spread (min-max over runs) of both."""
    t = table(results)
    if policy not in t:
        raise SystemExit(f"error: policy {policy!r} is not in the sweep ({', '.join(results['policies'])})")
    rows = []
    for rate in sorted(results["settings"]["rates"]):
        row: dict = {"rate": rate}
        for key, name in (("attainment", "attainment"), ("goodput_tok_s", "goodput")):
            med = {p: (t[p][rate][key] or {"median": 0.0})["median"] for p in t if p != policy}
            best = max(med, key=lambda p: med[p])
            mine = t[policy][rate][key] or {"median": 0.0, "min": 0.0, "max": 0.0}
            theirs = t[best][rate][key] or {"median": 0.0, "min": 0.0, "max": 0.0}
            row[name] = {"policy": mine, "best": best, "best_value": theirs,
                         "ratio": mine["median"] / theirs["median"] if theirs["median"] else None}
        rows.append(row)
    return rows


def envelope_markdown(policy: str, rows: list[dict]) -> str:
    def v(agg: dict, scale: float) -> str:
        return f"{scale * agg['median']:.0f} ({scale * agg['min']:.0f}-{scale * agg['max']:.0f})"

    lines = [f"| rate req/s | {policy} attainment % | best other | ratio | {policy} goodput tok/s | best other "
             "| ratio |", "|---:|---:|---|---:|---:|---|---:|"]
    for r in rows:
        a, g = r["attainment"], r["goodput"]
        lines.append(f"| {r['rate']:g} | {v(a['policy'], 100)} | {display(a['best'])} {v(a['best_value'], 100)} | "
                     f"{a['ratio']:.2f}x | {v(g['policy'], 1)} | {display(g['best'])} {v(g['best_value'], 1)} | "
                     f"{g['ratio']:.2f}x |" if a["ratio"] is not None and g["ratio"] is not None else
                     f"| {r['rate']:g} | - | - | - | - | - | - |")
    return "\n".join(lines)


def markdown(r: dict) -> str:
    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    note = {"": "", "below": " (below 50 % already at the lowest rate)",
            "above": " (never fell to 50 %: the highest rate)"}[r["flag"]]
    lines = [f"Best baseline: `{display(r['best_baseline'])}`, 50 % attainment at {r['rate']:g} req/s{note} "
             f"(goodput there {r['baseline_goodput']:.0f} tok/s). 50 % rates of the baselines: "
             + ", ".join(f"{b} {h['rate']:g}{' (' + h['flag'] + ')' if h['flag'] else ''}"
                         for b, h in r["half_rates"].items()) + ".", "",
             "| policy | attainment there | ratio | goodput there (tok/s) | ratio "
             "| up to (attainment / goodput, measured rates) |",
             "|---|---:|---:|---:|---:|---:|"]
    for p, v in r["policies"].items():
        lines.append(f"| {display(p)} | {100 * v['attainment']:.0f} % | {x(v['attainment_ratio'])} | "
                     f"{v['goodput']:.0f} | {x(v['goodput_ratio'])} | {x(v['up_to_attainment'])} / "
                     f"{x(v['up_to_goodput'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", nargs="+", help="sweep.json or .json.xz files of bench/sweep.py (same policies)")
    ap.add_argument("--policies", default=None, help="semicolon-separated (default: every non-baseline policy); "
                    f"the SpecInfer tree is {SPECINFER_TREE}")
    ap.add_argument("--baselines", default=",".join(BASELINE_PREFIXES),
                    help="policy-name prefixes that are baselines (AdaServe's own: 'none,tree:')")
    ap.add_argument("--json", default=None, help="also write the ratios here")
    ap.add_argument("--envelope", default=None, metavar="POLICY",
                    help="also print POLICY / the best other policy at every rate (attainment and goodput)")
    args = ap.parse_args(argv)
    missing = [p for p in args.sweeps if not Path(p).is_file()]
    if missing:
        print(f"error: no such sweep file: {missing[0]}", file=sys.stderr)
        return 2
    sweep = merged([load_result(p) for p in args.sweeps])
    r = ratios(sweep, args.policies.split(";") if args.policies else None, tuple(args.baselines.split(",")))
    print(markdown(r))
    if args.envelope:
        rows = envelope(sweep, args.envelope)
        r = r | {"envelope": {"policy": args.envelope, "rows": rows}}
        print()
        print(envelope_markdown(args.envelope, rows))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
