"""The policy sweep: SLO attainment and goodput vs request rate, every policy side by side, with figures.

    .venv/bin/python bench/sweep.py            # the full sweep (under 30 min on 2 CPU cores)
    .venv/bin/python bench/sweep.py --quick    # one run, two rates, no calibration (under 5 min)
    .venv/bin/python bench/sweep.py --replot bench/results/sweep-full/sweep.json.xz   # figures and docs only

Method (AdaServe §5 scaled to this machine, see docs/lab/sweep.md):
1. `specserve profile` measures the target once: budget B and the baseline latency (min per-iteration
   latency of batch-8 incremental decoding, input 32, output 128). Every gateway of the sweep reads
   that one profile, so every policy sees the same B and the same SLO classes (critical / search /
   chat = 1.0x / 2.4x / 8x the baseline).
2. chain:K for the best K (full sweep only): each K in --chain-ks serves one load point at
   --calibration-rate; the K with the highest goodput is the chain policy of the sweep.
3. For each run and each policy (`NAME@slo`: with SLO-aware admission, the default system being
   `joint@slo`; a plain name: FIFO admission; the order rotates by run, so drift hits all policies alike), the
   target, draft and gateway are started fresh, warmed up, and then:
   - in the first run, a concurrency-1 point: the first short prompts in order, 64 tokens each,
     critical tier (the prompts and length bench/hf_peer.py uses);
   - one load point per rate, lowest first: Poisson arrivals for --duration-s seconds (at least
     --min-requests requests), AdaServe's mix (60% critical on short prompts, 20% search on long
     prompts, 20% chat on short prompts), greedy, EOS ignored so that every request generates its
     prompt row's max_tokens. Run r uses the same seeds for every policy: the same prompts at the same
     times.
4. The full sweep then runs bench/hf_peer.py once (transformers generate, assisted and batched), so
   the peer is measured on the same day as our servers.
5. Medians over runs (min-max beside them) go to sweep.json, the PNG figures and a generated section
   of docs/lab/sweep.md, or docs/lab/sweep_sim.md for a simulated sweep (between markers;
   text outside them is left alone; --docs names another file).

Per-request JSONL records and per-point summaries stay in --out-dir (bench/results/sweep-<name>/).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import lzma
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from specserve.cli.loadgen.runner import BenchConfig, run_bench
from specserve.cli.loadgen.scrape import PARTS
from specserve.cli.loadgen.workload import DEFAULT_MIX
from specserve.shared.host.launch import ServiceProcess

ROOT = Path(__file__).resolve().parent.parent

SPECINFER_TREE = "tree:1,1,3,1,1,1,1,1"
CATEGORIES = ("critical", "search", "chat")
# Rates span light load to past overload for the bundled pair on 2 CPU cores (plain batching
# saturates near 1 req/s of this mix there); each mode is sized to its time limit (30 / 5 minutes).
MODES = {
    "full": {"rates": [0.25, 0.5, 1.0, 2.0], "duration_s": 8.0, "min_requests": 5, "runs": 3,
             "chain_ks": [2, 4, 6], "solo_requests": 8},
    "quick": {"rates": [0.5, 2.0], "duration_s": 6.0, "min_requests": 4, "runs": 1, "chain_ks": [4],
              "solo_requests": 3},
}
SOLO = {"max_tokens": 64, "mix": "critical=1:short"}  # plus the mode's solo_requests, first run only
METRICS = ("attainment", "goodput_tok_s", "throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
           "tokens_per_step")


def display(policy: str) -> str:
    """A short name for figures: the SpecInfer tree's spec is long."""
    return "specinfer-tree" if policy == SPECINFER_TREE else policy


def policies_for(chain_k: int) -> list[str]:
    return ["none", f"chain:{chain_k}", SPECINFER_TREE, "equal-greedy", "global-greedy", "adaserve"]


# ------------------------------------------------------------------------------------------ the stack


class Stack:
    """Target, draft and gateway as fresh processes (target and draft start side by side)."""

    def __init__(self, policy: str, profile: Path, threads: int, gateway_args: list[str], simulate: str | None = None,
                 targets: int = 1):
        started: dict[str, ServiceProcess | Exception] = {}
        sim = ["--simulate", simulate] if simulate else []  # simulated model services (docs/simulation.md)

        def start(kind: str) -> None:
            try:
                # on Unix sockets, as `specserve up` runs them on one host
                started[kind] = ServiceProcess(kind.split("-")[0], *sim, threads=threads, unix=True)
            except Exception as exc:  # reported below, after both have had their chance
                started[kind] = exc

        kinds = ["target"] if targets == 1 else [f"target-{i}" for i in range(targets)]
        workers = [threading.Thread(target=start, args=(k,)) for k in (*kinds, "draft")]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        self.procs = [p for p in started.values() if isinstance(p, ServiceProcess)]
        errors = [p for p in started.values() if isinstance(p, Exception)]
        if errors:
            self.stop()
            raise errors[0]
        replicas = [arg for k in kinds for arg in ("--target", started[k].address)]
        self.gateway = ServiceProcess("gateway", "--draft", started["draft"].address, *replicas,
                                      *policy_args(policy, gateway_args), "--profile", str(profile), *gateway_args)
        self.procs.append(self.gateway)
        self.url = self.gateway.address

    def stop(self) -> None:
        for p in self.procs:  # all three at once, then wait for each
            if p.alive():
                p.proc.terminate()
        for p in reversed(self.procs):
            p.stop()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def measure_profile(path: Path, threads: int, quick: bool, simulate: str | None = None) -> dict:
    """`specserve profile` on a fresh target (a simulated one with `simulate`), written to `path`."""
    if simulate:
        target = ServiceProcess("target", "--simulate", simulate, threads=threads)
        try:
            cmd = [sys.executable, "-m", "specserve.cli", "profile", "--target", target.address, "--out", str(path),
                   *(["--quick"] if quick else [])]
            done = subprocess.run(cmd, capture_output=True, text=True)
        finally:
            target.stop()
        if done.returncode != 0:
            raise RuntimeError(f"specserve profile failed:\n{done.stderr[-2000:]}")
        profile = relative_paths(json.loads(path.read_text()))
        path.write_text(json.dumps(profile, indent=1) + "\n")
        return profile
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "specserve.cli", "profile", "--threads", str(threads), "--out", str(path),
           *(["--quick"] if quick else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"specserve profile failed:\n{done.stderr[-2000:]}")
    profile = relative_paths(json.loads(path.read_text()))
    path.write_text(json.dumps(profile, indent=1) + "\n")
    return profile


def relative_paths(obj):
    """`obj` with every string path inside this checkout made relative to it (results are committed)."""
    root = f"{ROOT}/"
    if isinstance(obj, str):
        return obj.removeprefix(root)
    if isinstance(obj, dict):
        return {k: relative_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [relative_paths(v) for v in obj]
    return obj


def slo_classes(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/slo_classes", timeout=30) as resp:
        return json.load(resp)


# ------------------------------------------------------------------------------------------ one point


def bench_point(url: str, out: Path, label: str, **fields) -> dict:
    cfg = BenchConfig(url=url, out=str(out), label=label, ignore_eos=True, progress=False, **fields)
    summary, _ = asyncio.run(run_bench(cfg))
    if summary["errors"]:
        print(f"  {label}: {summary['errors']} failed requests: {summary['error_kinds']}", file=sys.stderr)
    return summary


def warm_up(url: str, out: Path) -> None:
    """A few requests through every path (prefill, speculation, streaming) before anything is timed."""
    bench_point(url, out, "warm-up", num_requests=4, max_tokens=8, seed=999)


def load_point(url: str, out: Path, label: str, rate: float, duration_s: float, min_requests: int, seed: int,
               mix: str = DEFAULT_MIX) -> dict:
    n = max(min_requests, round(rate * duration_s))
    return bench_point(url, out, label, num_requests=n, request_rate=rate, mix=mix, seed=seed)


def solo_point(url: str, out: Path, label: str, requests: int) -> dict:
    return bench_point(url, out, label, num_requests=requests, max_tokens=SOLO["max_tokens"],
                       mix=SOLO["mix"], sequential_prompts=True, max_concurrency=1)


def policy_args(policy: str, gateway_args: list[str]) -> list[str]:
    """A sweep's policy as gateway flags: `NAME@slo` (or `@fifo`) names the admission too; a plain name
    runs with FIFO admission (every figure taken before SLO admission became the default, 2026-11-25),
    unless `gateway_args` names one. The default system is `joint@slo`. Flags after the name are that
    policy's own (`'joint@slo --max-width 1'`)."""
    head, *own = policy.split()
    name, _, admission = head.partition("@")
    if "--admission" in gateway_args:
        return ["--policy", name, *own] if not admission else ["--policy", name, "--admission", admission, *own]
    return ["--policy", name, "--admission", admission or "fifo", *own]


def slug(policy: str) -> str:
    return policy.replace(":", "-").replace(",", "").replace(" ", "")


# ------------------------------------------------------------------------------------------ the sweep


def run_sweep(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    mode = "quick" if args.quick else "full"
    name = args.name or mode
    gateway_args = args.gateway_args.split()
    settings = dict(MODES[mode])
    for key in ("rates", "duration_s", "runs", "chain_ks", "min_requests", "solo_requests"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    out_dir = Path(args.out_dir or ROOT / "bench" / "results" / f"sweep-{name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    profile_path = Path(args.profile) if args.profile else out_dir / "profile.json"
    if args.profile:
        profile = json.loads(profile_path.read_text())
    else:
        print(f"measuring the target (specserve profile -> {profile_path}) ...", file=sys.stderr, flush=True)
        profile = measure_profile(profile_path, args.threads, args.quick, args.simulate)
    print(f"budget B = {profile['budget_tokens']} tokens, baseline {profile['baseline_iteration_ms']:.2f} ms",
          file=sys.stderr, flush=True)

    ks = settings["chain_ks"]
    calibration: dict[str, dict] = {}
    rates = sorted(settings["rates"])
    runs = settings["runs"]
    n_policies = len(args.policies.split(";") if args.policies else policies_for(0))
    n_points = (len(ks) if len(ks) > 1 else 0) + n_policies * (runs * len(rates) + 1)
    bar = tqdm(total=n_points, desc="sweep", unit="point", file=sys.stderr, dynamic_ncols=True)
    if len(ks) > 1:
        for k in ks:
            bar.set_postfix_str(f"calibrating chain:{k} at {args.calibration_rate} req/s")
            with Stack(f"chain:{k}", profile_path, args.threads, gateway_args, args.simulate) as stack:
                warm_up(stack.url, out_dir / "warm-up.jsonl")
                calibration[f"chain:{k}"] = load_point(stack.url, out_dir / f"calibrate-chain-{k}.jsonl", f"chain:{k}",
                                                       args.calibration_rate, settings["duration_s"],
                                                       settings["min_requests"], args.seed + 7)
            bar.update(1)
        best = max(ks, key=lambda k: (calibration[f"chain:{k}"]["goodput_tok_s"] or 0.0,
                                      calibration[f"chain:{k}"]["attainment"] or 0.0))
    else:
        best = ks[0]
    policies = args.policies.split(";") if args.policies else policies_for(best)

    points, solo = [], []
    classes = None
    for run in range(runs):
        order = policies[run % len(policies):] + policies[:run % len(policies)]
        for policy in order:
            bar.set_postfix_str(f"run {run + 1}/{runs} {policy}: starting")
            with Stack(policy, profile_path, args.threads, gateway_args, args.simulate) as stack:
                classes = classes or slo_classes(stack.url)
                warm_up(stack.url, out_dir / "warm-up.jsonl")
                if run == 0:
                    bar.set_postfix_str(f"run {run + 1}/{runs} {policy}: concurrency 1")
                    s = solo_point(stack.url, out_dir / f"{slug(policy)}-solo.jsonl", policy, settings["solo_requests"])
                    solo.append({"policy": policy, "run": run, "summary": s})
                    bar.update(1)
                for i, rate in enumerate(rates):
                    bar.set_postfix_str(f"run {run + 1}/{runs} {policy}: {rate:g} req/s")
                    s = load_point(stack.url, out_dir / f"{slug(policy)}-rate{rate:g}-run{run}.jsonl", policy, rate,
                                   settings["duration_s"], settings["min_requests"], args.seed + 1000 * run + i,
                                   args.mix)
                    points.append({"policy": policy, "rate": rate, "run": run, "summary": s})
                    bar.update(1)
    bar.close()
    results = {
        "meta": machine_info() | {"mode": mode, "name": name, "wall_s": round(time.time() - t_start, 1),
                                  "simulated": args.simulate},
        "settings": settings | {"seed": args.seed, "mix": args.mix,
                                "calibration_rate": args.calibration_rate, "threads": args.threads,
                                "gateway_args": gateway_args,
                                "solo": SOLO},
        "profile": {k: profile[k] for k in ("budget_tokens", "baseline_iteration_ms", "curve", "reference_ms")
                    if k in profile},
        "classes": classes["classes"] if classes else None,
        "chain_calibration": {k: _pick(s) for k, s in calibration.items()},
        "chain_k": best,
        "policies": policies,
        "points": points,
        "solo": solo,
        "hf_peer": (None if args.quick or args.simulate
                    else run_hf_peer(out_dir / "hf_peer.json", settings["solo_requests"])),
    }
    results = relative_paths(results)
    (out_dir / "sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def run_hf_peer(out: Path, prompts: int) -> dict | None:
    """bench/hf_peer.py in this sweep (one run; the machine's speed drifts between days, so the peer is
    measured beside our servers rather than read from an older file). None if it fails."""
    print("transformers peer (bench/hf_peer.py) ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, str(ROOT / "bench" / "hf_peer.py"), "--runs", "1", "--prompts", str(prompts),
           "--max-tokens", str(SOLO["max_tokens"]), "--batch-sizes", "8,16", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"  hf_peer failed:\n{done.stderr[-1500:]}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def _pick(s: dict) -> dict:
    return {k: s.get(k) for k in ("attainment", "goodput_tok_s", "throughput_tok_s", "tokens_per_step")}


def load_result(path: str | Path) -> Any:
    """A result file's JSON; a name ending in .xz is read through xz (the repository keeps result files
    over 30 KB compressed: `sweep-<name>/sweep.json.xz`, written plain by the runs)."""
    raw = Path(path).read_bytes()
    return json.loads(lzma.decompress(raw) if str(path).endswith(".xz") else raw)


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    import torch
    import transformers

    commit = git("rev-parse", "--short", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "cpu": cpu,
            "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": commit}


# ------------------------------------------------------------------------------------------ aggregation


def _get(summary: dict, key: str):
    node = summary
    for part in key.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return None
        node = node[part]
    return node


def aggregate(rows: list[dict], key: str) -> dict | None:
    """Median, min and max of one metric over runs (None where no run has it)."""
    vals = [v for v in (_get(r["summary"], key) for r in rows) if v is not None]
    if not vals:
        return None
    return {**spread(vals), "n": len(vals)}


def spread(values: list[float]) -> dict:
    """Median, min and max of a non-empty list: how every bench reports runs or rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def table(results: dict) -> dict:
    """{policy: {rate: {metric: agg}}} over the load points; metrics include per-category attainment
    and the iteration split."""
    keys = [*METRICS, "iteration.mean_ms", "acceptance_rate",
            *(f"iteration.share.{p}" for p in PARTS), *(f"categories.{c}.attainment" for c in CATEGORIES)]
    out: dict[str, dict[float, dict]] = {}
    for p in results["policies"]:
        out[p] = {}
        for rate in results["settings"]["rates"]:
            rows = [x for x in results["points"] if x["policy"] == p and x["rate"] == rate]
            out[p][rate] = {k: aggregate(rows, k) for k in keys}
    return out


def solo_table(results: dict) -> dict:
    return {p: {k: aggregate([x for x in results["solo"] if x["policy"] == p], k)
                for k in ("throughput_tok_s", "tpot_p50_ms", "ttft_p50_ms", "tokens_per_step")}
            for p in results["policies"]}


# ------------------------------------------------------------------------------------------ figures


def plot(results: dict, fig_dir: Path, prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    t = table(results)
    rates = sorted(results["settings"]["rates"])
    runs = results["settings"]["runs"]
    note = f"median of {runs} run{'s' if runs > 1 else ''}" + (" (band: min-max)" if runs > 1 else "")
    sim = results["meta"].get("simulated")
    label = f"SIMULATED ({sim})" if sim else "real CPU"  # every figure's title says which it is
    paths = []

    def lines(ax, key: str, scale: float = 1.0) -> None:
        for p in results["policies"]:
            aggs = [t[p][r][key] for r in rates]
            xs = [r for r, a in zip(rates, aggs) if a]
            med = [a["median"] * scale for a in aggs if a]
            ax.plot(xs, med, marker="o", label=display(p), linewidth=2 if p == "adaserve" else 1.2)
            if runs > 1:
                ax.fill_between(xs, [a["min"] * scale for a in aggs if a], [a["max"] * scale for a in aggs if a],
                                alpha=0.12)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.grid(alpha=0.3)

    def save(fig, name: str) -> None:
        path = fig_dir / f"{prefix}-{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    for key, name, ylabel, scale in (("attainment", "attainment", "TPOT SLO attainment (%)", 100.0),
                                     ("goodput_tok_s", "goodput", "goodput (tokens/s of requests meeting SLO)", 1.0)):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        lines(ax, key, scale)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{label}: {ylabel.split(' (')[0]} vs load\n{note}", fontsize=10)
        ax.legend(fontsize=8)
        save(fig, name)

    classes = results.get("classes") or {}
    fig, axes = plt.subplots(1, len(CATEGORIES), figsize=(13, 4), sharey=True)
    for ax, c in zip(axes, CATEGORIES):
        lines(ax, f"categories.{c}.attainment", 100.0)
        slo = classes.get(c, {}).get("tpot_ms")
        ax.set_title(f"{c} (TPOT SLO {slo:.1f} ms)" if slo else c)
    axes[0].set_ylabel("TPOT SLO attainment (%)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{label}: TPOT SLO attainment per category vs load, {note}", fontsize=10)
    save(fig, "attainment-per-category")

    fig, axes = plt.subplots(1, len(rates), figsize=(3.2 * len(rates), 4.2), sharey=True)
    axes = list(axes) if len(rates) > 1 else [axes]
    colors = {"draft": "tab:orange", "target": "tab:blue", "transport": "tab:gray", "schedule": "tab:green"}
    for ax, r in zip(axes, rates):
        bottom = [0.0] * len(results["policies"])
        for part in PARTS:
            vals = []
            for p in results["policies"]:
                mean, share = t[p][r]["iteration.mean_ms"], t[p][r][f"iteration.share.{part}"]
                vals.append(mean["median"] * share["median"] if mean and share else 0.0)
            ax.bar(range(len(vals)), vals, bottom=bottom, color=colors[part], label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(results["policies"])), [display(p) for p in results["policies"]],
                      rotation=60, fontsize=7)
        ax.set_title(f"{r:g} req/s", fontsize=9)
    axes[0].set_ylabel("ms per engine iteration")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{label}: where an iteration's time goes (draft / target inside the services, transport, "
                 "scheduling)", fontsize=9)
    save(fig, "iteration-split")
    return paths


# ------------------------------------------------------------------------------------------ docs


def _fmt(agg: dict | None, spec: str = ".1f", scale: float = 1.0, spread: bool = False) -> str:
    if agg is None:
        return "-"
    s = format(agg["median"] * scale, spec)
    if spread and agg["n"] > 1:
        s += f" ({format(agg['min'] * scale, spec)}-{format(agg['max'] * scale, spec)})"
    return s


def markdown(results: dict, fig_dir: Path, docs_path: Path) -> str:
    t = table(results)
    st = solo_table(results)
    rates = sorted(results["settings"]["rates"])
    m, s, prof = results["meta"], results["settings"], results["profile"]
    policies = results["policies"]
    rel = os.path.relpath(fig_dir, docs_path.parent)
    prefix = f"sweep-{_name(results)}"
    head = "| policy | " + " | ".join(f"{r:g} req/s" for r in rates) + " |\n|---|" + "---:|" * len(rates)

    def grid(key: str, spec: str, scale: float = 1.0, spread: bool = False) -> str:
        rows = [head]
        for p in policies:
            rows.append(f"| {p} | " + " | ".join(_fmt(t[p][r][key], spec, scale, spread) for r in rates) + " |")
        return "\n".join(rows)

    classes = results.get("classes") or {}
    cls = ", ".join(f"{c} {classes[c]['tpot_ms']:.1f} ms" for c in CATEGORIES if c in classes)
    sim = m.get("simulated")
    out = [
        *([f"**SIMULATED** (`--simulate {sim}`): the model services' passes take the preset's modelled time "
           "(its sources and assumptions: shared/simulate/presets/, docs/simulation.md); the gateway, policies "
           "and load generator are real.", ""] if sim else []),
        f"Generated by `bench/sweep.py{_flags(results)}` on {m['date']} (the commit is in the results' "
        f"meta); {m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']}, "
        f"transformers {m['transformers']}. Wall time {m['wall_s'] / 60:.1f} min.",
        "",
        f"- Target and draft services at {s['threads']} torch thread each, one gateway, the load generator in "
        f"the sweep's process: all on the same {m['cores']} cores.",
        f"- Profile: B = {prof['budget_tokens']} tokens per pass, baseline latency "
        f"{prof['baseline_iteration_ms']:.2f} ms. TPOT SLOs: {cls}.",
        f"- Mix {s['mix']}; Poisson arrivals for {s['duration_s']:g} s per point (at least {s['min_requests']} "
        f"requests), greedy, EOS ignored (each request generates its prompt row's max_tokens).",
        f"- {s['runs']} run{'s' if s['runs'] > 1 else ''} per point, policies rotated per run, services restarted "
        f"per policy; tables give the median{' (min-max)' if s['runs'] > 1 else ''} over runs.",
    ]
    if results["chain_calibration"]:
        cal = ", ".join(f"{k}: {_num(v['goodput_tok_s'])} tok/s goodput, {_num(v['attainment'], 100)} % attainment"
                        for k, v in results["chain_calibration"].items())
        out.append(f"- chain:K calibration at {s['calibration_rate']:g} req/s (one run): {cal}. "
                   f"Best: chain:{results['chain_k']}.")
    else:
        out.append(f"- chain:K: K = {results['chain_k']} (not calibrated in this mode).")
    out += [
        "",
        "**TPOT SLO attainment (%)**",
        "",
        grid("attainment", ".0f", 100.0, spread=True),
        "",
        "**Goodput (tokens/s of requests that met their TPOT SLO)**",
        "",
        grid("goodput_tok_s", ".0f", spread=True),
        "",
    ]
    for c in CATEGORIES:
        slo = classes.get(c, {}).get("tpot_ms")
        out += [f"**Attainment (%), {c} requests** (TPOT SLO {slo:.1f} ms)" if slo else f"**Attainment (%), {c}**",
                "", grid(f"categories.{c}.attainment", ".0f", 100.0), ""]
    out += [
        "**Throughput (tokens/s, all completed requests)**", "", grid("throughput_tok_s", ".0f"), "",
        "**TTFT p50 / p99 (ms)**", "",
        head,
        *(f"| {p} | " + " | ".join(f"{_fmt(t[p][r]['ttft_p50_ms'], '.0f')} / {_fmt(t[p][r]['ttft_p99_ms'], '.0f')}"
                                   for r in rates) + " |" for p in policies),
        "",
        "**Mean tokens per verify step (1 + accepted draft tokens)**", "", grid("tokens_per_step", ".2f"), "",
        "**Iteration time split: mean ms per engine iteration, and draft / target / transport / scheduling (%)**",
        "",
        head,
    ]
    for p in policies:
        cells = []
        for r in rates:
            row = t[p][r]
            shares = "/".join(_fmt(row[f"iteration.share.{part}"], ".0f", 100.0) for part in PARTS)
            cells.append(f"{_fmt(row['iteration.mean_ms'], '.1f')} ms: {shares}")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    n_solo = s["solo_requests"]
    out += ["", f"**Concurrency 1** (the first {n_solo} short prompts in order, one at a time, "
            f"{s['solo']['max_tokens']} tokens each, critical tier, first run only; `bench/hf_peer.py` runs "
            "the first 8 of the same prompts at the same length through transformers)", "",
            "| server | tokens/s | TPOT p50 (ms) | TTFT p50 (ms) | tokens/step | best tokens/s under load |",
            "|---|---:|---:|---:|---:|---:|"]
    for p in policies:
        r = st[p]
        best = max(((t[p][x]["throughput_tok_s"]["median"], x) for x in rates if t[p][x]["throughput_tok_s"]),
                   default=None)
        out.append(f"| specserve {p} | {_fmt(r['throughput_tok_s'], '.0f')} | {_fmt(r['tpot_p50_ms'], '.2f')} | "
                   f"{_fmt(r['ttft_p50_ms'], '.1f')} | {_fmt(r['tokens_per_step'], '.2f')} | "
                   f"{'-' if best is None else f'{best[0]:.0f} (at {best[1]:g} req/s)'} |")
    peer = results.get("hf_peer")
    if peer:
        for mode in ("generate", "assisted"):
            r = peer["results"][mode]
            acc = r.get("acceptance", {}).get("tokens_per_target_forward")
            out.append(f"| transformers {mode} (batch 1) | {r['tokens_per_s']['median']:.0f} | "
                       f"{r['tpot_ms']['median']:.2f} | {r['ttft_ms']['median']:.1f} | "
                       f"{'-' if acc is None else f'{acc:.2f}'} | - |")
        best = peer["results"]["batched"]["best"]
        out.append(f"| transformers batched generate (all {peer['meta']['prompts']} prompts at once, best batch "
                   f"size {best['batch_size']}) | - | - | - | - | {best['tokens_per_s']:.0f} |")
    out += ["", *(f"![{name}]({rel}/{prefix}-{name}.png)" for name in
                  ("attainment", "goodput", "attainment-per-category", "iteration-split"))]
    return "\n".join(out)


def _flags(results: dict) -> str:
    """The sweep's distinguishing command-line flags, for the docs."""
    m, s = results["meta"], results["settings"]
    flags = " --quick" if m["mode"] == "quick" else ""
    if _name(results) != m["mode"]:
        flags += f" --name {_name(results)}"
    if s.get("gateway_args"):
        flags += f" --gateway-args '{' '.join(s['gateway_args'])}'"
    if m.get("simulated"):
        flags += f" --simulate '{m['simulated']}'"
    return flags


def _name(results: dict) -> str:
    return results["meta"].get("name") or results["meta"]["mode"]


def _num(v, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.0f}"


def default_docs(results: dict) -> Path:
    """Where a sweep's generated section goes: the real CPU's sweeps and the simulated ones have a file each."""
    return ROOT / "docs" / "lab" / ("sweep_sim.md" if results["meta"].get("simulated") else "sweep.md")


def write_docs(results: dict, docs_path: Path, fig_dir: Path) -> None:
    """Replace (or append) this mode's generated section of the docs file (`default_docs`)."""
    mode, name = results["meta"]["mode"], _name(results)
    begin, end = f"<!-- sweep:{name}:begin -->", f"<!-- sweep:{name}:end -->"
    body = f"{begin}\n{markdown(results, fig_dir, docs_path)}\n{end}"
    text = docs_path.read_text() if docs_path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        a, rest = text.split(begin, 1)
        text = a + body + rest.split(end, 1)[1]
    else:
        title = "full sweep" if mode == "full" else "quick sweep (`--quick`)"
        if name != mode:
            title += f" `--name {name}`"
        text = text.rstrip("\n") + f"\n\n### Generated: the {title}\n\n{body}\n"
    docs_path.write_text(text)


# ------------------------------------------------------------------------------------------ main


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one run at three rates (under 5 minutes)")
    ap.add_argument("--rates", type=_floats, default=None, help="request rates, req/s (comma-separated)")
    ap.add_argument("--duration-s", type=float, default=None, help="seconds of arrivals per load point")
    ap.add_argument("--min-requests", type=int, default=None, help="fewest requests per load point")
    ap.add_argument("--runs", type=int, default=None, help="runs per point (medians are reported)")
    ap.add_argument("--solo-requests", type=int, default=None, help="requests of the concurrency-1 point (first run)")
    ap.add_argument("--chain-ks", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="K values tried for chain:K (one value: no calibration)")
    ap.add_argument("--calibration-rate", type=float, default=1.0, help="the chain:K calibration's request rate")
    ap.add_argument("--policies", default=None,
                    help="';'-separated policies instead of the default six (e.g. 'none;adaserve'); flags after "
                         "a name are its own ('joint@slo --max-width 1')")
    ap.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    ap.add_argument("--simulate", default=None, metavar="PRESET",
                    help="simulated model services (docs/simulation.md); results are labelled simulated")
    ap.add_argument("--gateway-args", default="", help="more flags for every gateway (e.g. '--budget 16')")
    ap.add_argument("--name", default=None,
                    help="names this sweep's results, figures and docs section (default: full or quick)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each model service")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", default=DEFAULT_MIX, help="the load points' mix: CLASS=SHARE:PROMPTS,... (the "
                    "concurrency-1 point keeps its own)")
    ap.add_argument("--out-dir", default=None, help="default bench/results/sweep-<name>")
    ap.add_argument("--docs", default=None, help="markdown file to update ('' : none; default "
                    "docs/lab/sweep.md, or docs/lab/sweep_sim.md for a simulated sweep)")
    ap.add_argument("--fig-dir", default=str(ROOT / "docs" / "figures"))
    ap.add_argument("--replot", metavar="SWEEP_JSON", help="only redo the figures and docs from a sweep.json (.xz)")
    args = ap.parse_args(argv)
    for name in ("min_requests", "runs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rates is not None and (not args.rates or any(not (r > 0 and math.isfinite(r)) for r in args.rates)):
        ap.error("--rates must be positive, finite numbers")

    if importlib.util.find_spec("matplotlib") is None:  # fail now, not after a 25-minute sweep
        print("sweep: the figures need matplotlib: .venv/bin/pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if args.replot:
        results = load_result(args.replot)
    else:
        try:
            results = run_sweep(args)
        except (RuntimeError, ValueError, ConnectionError, OSError) as exc:
            print(f"sweep: {exc}", file=sys.stderr)
            return 1
    fig_dir = Path(args.fig_dir)
    paths = plot(results, fig_dir, f"sweep-{_name(results)}")
    docs = default_docs(results) if args.docs is None else Path(args.docs) if args.docs else None
    if docs is not None:
        write_docs(results, docs, fig_dir)
    print(markdown(results, fig_dir, docs or default_docs(results)))
    print("\nfigures: " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
