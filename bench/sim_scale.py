"""One gateway in front of N simulated target replicas at GPU-scale timings: the gateway's own
scheduling time per iteration and its share of the iteration, at batch b per replica.

    .venv/bin/python bench/sim_scale.py [--preset llama2-7b-a100] [--targets 8]
        [--batches 1,32,128] [--policy adaserve] [--runs 3] [--py-spy DIR]

The services are simulated (docs/simulation.md): the target passes and draft steps take the
preset's modelled time and almost no CPU, so what remains on this 2-core machine is the gateway
and the load generator, which shares the cores. Each point sends targets x b requests at once (at
most that many in flight; short prompts, critical tier, `--max-tokens` tokens, EOS ignored) and
reads the gateway's iteration counters
(specserve:iteration_{draft,target,transport,schedule}_seconds_total, iterations_total) before
and after. Each point runs `--runs` times on the same stack, in rounds (every batch once, then
again); the medians and the runs' range are reported.

Whose CPU is whose: the CPU seconds (user + system, from /proc on Linux) of each process over each
point, per gateway iteration: the gateway, the load generator (this process), the target replicas
and the draft. When they add up to more than the cores can give in the point's wall time, every
process waited for a core, and the gateway's schedule time is inflated by that wait.

`--py-spy DIR` (py-spy must be installed: `pip install py-spy`, the `bench` extra) samples the
gateway process during one extra run per point (not timed) and writes DIR/b<b>.txt (py-spy's raw
collapsed stacks) and DIR/b<b>.json (the top functions by own and by cumulative samples).

Results: bench/results/sim_scale.json (labelled simulated, with the preset).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import ROOT, Stack, bench_point, measure_profile, warm_up  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of stat)


def children(pid: int) -> list[int]:
    """The pids of a process's children (Linux /proc), e.g. the gateway's front ends (--frontends N)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def cpu_of(stack: Stack) -> dict[str, float | None]:
    """CPU seconds so far: the gateway (with its front-end processes, if any), the targets and the draft
    (summed), and this process. A front end started again mid-point would lose its predecessor's share."""
    own = os.times()
    pid = stack.gateway.proc.pid
    gateway = [cpu_seconds(p) for p in (pid, *children(pid))]
    out: dict[str, float | None] = {"gateway": None if gateway[0] is None else sum(v or 0.0 for v in gateway),
                                    "load_generator": own.user + own.system}
    for kind in ("target", "draft"):
        vals = [cpu_seconds(p.proc.pid) for p in stack.procs if p.kind == kind]
        out[kind] = None if any(v is None for v in vals) else sum(v for v in vals if v is not None)
    return out


def one_point(stack: Stack, tmp: Path, b: int, args: argparse.Namespace) -> dict:
    n = b * args.targets
    cpu0, t0, started = cpu_of(stack), time.perf_counter(), time.time()
    summary = bench_point(stack.url, tmp / f"b{b}.jsonl", f"b{b}", num_requests=n, max_concurrency=n,
                          max_tokens=args.max_tokens, mix="critical=1.0:short", timeout_s=1200)
    wall, cpu1 = time.perf_counter() - t0, cpu_of(stack)
    it = summary["iteration"]
    iters = it["iterations"]
    per_iter = {p: s / iters * 1e3 for p, s in it["seconds"].items()} if iters else {}
    cpu = {k: (cpu1[k] - cpu0[k]) if cpu1[k] is not None and cpu0[k] is not None else None for k in cpu0}
    tokens = (n - summary["errors"]) * args.max_tokens  # output tokens of the point (EOS is ignored)
    return {"requests": n, "errors": summary["errors"], "iterations": iters, "iteration_ms": it["mean_ms"],
            "per_iteration_ms": per_iter, "share": it["share"], "tokens_per_step": summary["tokens_per_step"],
            "tpot_p50_ms": summary["tpot_p50_ms"], "throughput_tok_s": summary["throughput_tok_s"],
            "started_unix_s": started, "wall_s": wall, "cpu_s": cpu,
            "cpu_ms_per_iteration": {k: v / iters * 1e3 for k, v in cpu.items() if v is not None} if iters else {},
            "output_tokens": tokens,
            "gateway_cpu_us_per_output_token": cpu["gateway"] / tokens * 1e6 if cpu["gateway"] is not None and tokens
            else None,
            "cores_busy": sum(v for v in cpu.values() if v is not None) / wall}


def median_point(runs: list[dict]) -> dict:
    """The median of every number over the runs, with the runs' min and max for the headline ones."""

    def med(get):
        vals = [get(r) for r in runs]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    def rng(get):
        vals = [v for v in (get(r) for r in runs) if v is not None]
        return [min(vals), max(vals)] if vals else None

    first = runs[0]
    out = {"runs": len(runs), "requests": first["requests"], "errors": sum(r["errors"] for r in runs)}
    for key in ("iterations", "iteration_ms", "tokens_per_step", "tpot_p50_ms", "throughput_tok_s", "wall_s",
                "cores_busy", "gateway_cpu_us_per_output_token"):
        out[key] = med(lambda r, k=key: r[k])
    out["per_iteration_ms"] = {p: med(lambda r, p=p: r["per_iteration_ms"].get(p)) for p in first["per_iteration_ms"]}
    out["share"] = {p: med(lambda r, p=p: r["share"].get(p)) for p in first["share"]}
    out["cpu_ms_per_iteration"] = {k: med(lambda r, k=k: r["cpu_ms_per_iteration"].get(k))
                                   for k in first["cpu_ms_per_iteration"]}
    out["range"] = {"iteration_ms": rng(lambda r: r["iteration_ms"]),
                    "schedule_ms": rng(lambda r: r["per_iteration_ms"].get("schedule")),
                    "schedule_share": rng(lambda r: r["share"].get("schedule")),
                    "gateway_cpu_ms_per_iteration": rng(lambda r: r["cpu_ms_per_iteration"].get("gateway")),
                    "gateway_cpu_us_per_output_token": rng(lambda r: r["gateway_cpu_us_per_output_token"])}
    out["each_run"] = runs
    return out


def summarize_py_spy(raw: Path, top: int = 40) -> dict:
    """Top functions of py-spy's collapsed stacks: own samples (the innermost frame) and cumulative
    samples (any frame of the stack, counted once per stack)."""
    own: dict[str, int] = {}
    cum: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [_function(f) for f in stack.split(";")]
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            cum[f] = cum.get(f, 0) + n

    def table(d: dict[str, int]) -> list[list]:
        return [[f, n, round(n / total, 4)] for f, n in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {"samples": total, "own": table(own), "cumulative": table(cum)}


def _function(frame: str) -> str:
    """py-spy's "name (path/file.py:line)" as "name (file.py)": samples add up per function."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1]})" if where else name


def profile_point(stack: Stack, tmp: Path, b: int, args: argparse.Namespace, out_dir: Path) -> dict:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = out_dir / f"b{b}.txt"
    proc = subprocess.Popen([spy, "record", "--pid", str(stack.gateway.proc.pid), "--format", "raw", "--rate",
                             "200", "--output", str(raw), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # py-spy attaches
    point = one_point(stack, tmp, b, args)
    proc.send_signal(2)  # SIGINT: py-spy writes its output and exits
    _, err = proc.communicate(timeout=60)
    if not raw.exists():
        raise RuntimeError(f"py-spy wrote nothing: {err[-500:]}")
    summary = summarize_py_spy(raw) | {"point": {k: point[k] for k in ("iterations", "iteration_ms",
                                                                         "per_iteration_ms", "cpu_ms_per_iteration")}}
    (out_dir / f"b{b}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama2-7b-a100")
    ap.add_argument("--targets", type=int, default=8)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--policy", default="adaserve")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--gateway-args", default="", help="more flags for the gateway (e.g. --frontends 2)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per point (medians and range are reported)")
    ap.add_argument("--py-spy", dest="py_spy", default=None, metavar="DIR",
                    help="also profile the gateway with py-spy in one extra run per point, into DIR")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sim_scale.json"))
    ap.add_argument("--profile-out", default=None, help="write the simulated profile here (default: a temp dir)")
    args = ap.parse_args()
    if args.runs < 0 or args.targets < 1:
        ap.error("--runs must be >= 0 and --targets >= 1")
    # Simulated pools hold no tensors: size them for the largest batch (one draft serves every replica).
    batches = [int(b) for b in args.batches.split(",")]
    os.environ.setdefault("SPECSERVE_TARGET_KV_BLOCKS", str(max(batches) * 40))
    os.environ.setdefault("SPECSERVE_DRAFT_KV_BLOCKS", str(max(batches) * 40 * args.targets))
    tmp = Path(tempfile.mkdtemp(prefix="sim-scale-"))
    profile = Path(args.profile_out) if args.profile_out else tmp / "profile.json"
    measure_profile(profile, 1, quick=True, simulate=args.preset)
    result: dict = {"label": f"simulated, preset {args.preset}", "preset": args.preset, "targets": args.targets,
                    "policy": args.policy, "max_tokens": args.max_tokens, "runs": args.runs,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "profile": json.loads(profile.read_text()), "points": {}}
    # the gateway must admit b requests per replica at once
    gateway_args = ["--max-running", str(max(batches)), "--max-waiting", str(2 * max(batches) * args.targets),
                    *args.gateway_args.split()]
    result["gateway_args"] = gateway_args
    runs: dict[int, list[dict]] = {b: [] for b in batches}
    with Stack(args.policy, profile, 1, gateway_args, args.preset, targets=args.targets) as stack:
        warm_up(stack.url, tmp / "warm.jsonl")
        for i in range(args.runs):
            for b in batches:
                runs[b].append(one_point(stack, tmp, b, args))
                p = runs[b][-1]
                print(f"run {i + 1} b={b}: iteration {p['iteration_ms']:.1f} ms, schedule "
                      f"{p['per_iteration_ms'].get('schedule', 0):.1f} ms, gateway CPU "
                      f"{p['cpu_ms_per_iteration'].get('gateway', 0):.1f} ms/it, "
                      f"{p['gateway_cpu_us_per_output_token'] or 0:.0f} us/token", file=sys.stderr, flush=True)
                result["points"][str(b)] = median_point(runs[b])
                if args.runs:
                    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        if args.py_spy:
            out_dir = Path(args.py_spy)
            out_dir.mkdir(parents=True, exist_ok=True)
            for b in batches:
                s = profile_point(stack, tmp, b, args, out_dir)
                print(f"py-spy b={b}: {s['samples']} samples -> {out_dir}/b{b}.json", file=sys.stderr, flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
