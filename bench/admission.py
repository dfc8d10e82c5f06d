"""SLO-aware admission (`--admission slo`) against FIFO admission under load: issue 20's targets 1-3.

    python bench/admission.py knee       # target 1a: FIFO attainment vs rate on one real CPU replica
    python bench/admission.py overload   # target 1b: FIFO and SLO admission side by side at 2x the knee
    python bench/admission.py overload --rate 2.25 --mix flex=1:short --tag flex   # traffic with no SLO
    python bench/admission.py capacity --admission slo --targets 4 --simulate llama2-7b-a100 --router slo
    python bench/admission.py burst      # target 3: 3x the sustainable rate for 10 s, then back down
    python bench/admission.py spike --requests 150   # issue 30's burst: N critical requests at once
    python bench/admission.py report     # docs/lab/admission.md's generated section from the results

Every subcommand writes bench/results/admission/<name>.json (per-request JSONL records stay in
bench/results/admission/runs/, not committed); `report` regenerates the docs section from all of
them. Stacks are started as bench/sweep.py starts them (its `Stack`: fresh target(s), draft and
gateway processes per run), with the speculation policy `--policy` (default `none`: on this CPU plain
batching has the best attainment of every policy, docs/lab/sweep.md, so the comparison isolates
admission) and one shared profile (the same B and SLO classes for FIFO and SLO admission).

The mix is AdaServe's (the bench default: 60% critical on short prompts, 20% search on long ones,
20% chat on short ones), with the chat category sent as `service_tier: "flex"` (OpenAI's
lower-priority tier, an alias of chat): under SLO admission those requests may be served best
effort, the others are refused with 503 and Retry-After when no plan can meet their SLOs. FIFO
admission ignores the tier. Greedy, EOS ignored (each request generates its prompt row's max_tokens).

Each request ends in exactly one of: served within its TPOT and TTFT SLO (`slo_met`), served with an
SLO but missing it (`slo_missed`), served best effort, refused with 503 and Retry-After, or failed
otherwise (timeout, error, a 503 without Retry-After). Attainment is the bench's (TPOT; refused
requests count as missed); capacity is the highest rate with attainment >= 90% (SLOs-Serve's
definition). Timing figures: run each invocation under the machine's timing lock if others share it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import ROOT, Stack, machine_info, measure_profile, relative_paths  # noqa: E402

from specserve.cli.loadgen.records import RequestRecord  # noqa: E402
from specserve.cli.loadgen.runner import BenchConfig, run_bench  # noqa: E402
from specserve.cli.loadgen.scrape import scrape  # noqa: E402
from specserve.shared.wire.service_client import DraftClient, TargetClient  # noqa: E402

MIX = "critical=0.6:short,search=0.2:long,flex=0.2:short"  # AdaServe's mix; chat as service_tier flex
RESULTS = ROOT / "bench" / "results" / "admission"
REAL_PROFILE = ROOT / "bench" / "results" / "sweep-full" / "profile.json"  # the full sweep's (B = 8)
ADMISSION_ARGS = {"fifo": ["--admission", "fifo"], "slo": ["--admission", "slo"]}
GOAL_ATTAINMENT = 0.9


# ------------------------------------------------------------------------------------------ one run


def outcome(r: RequestRecord) -> str:
    """Where one request ended (module docstring)."""
    if r.ok:
        if r.best_effort:
            return "best_effort"
        return "slo_met" if r.slo_met else "slo_missed"
    if r.status == 503 and r.retry_after_s is not None:
        return "refused"
    return "failed"


OUTCOMES = ("slo_met", "slo_missed", "best_effort", "refused", "failed")


def account(records: list[RequestRecord]) -> dict:
    """Counts per outcome, and how fast the refusals came back."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for r in records:
        counts[outcome(r)] += 1
    refused_ms = [r.status_ms for r in records if outcome(r) == "refused" and r.status_ms is not None]
    return {"outcomes": counts,
            "refused_status_ms_max": max(refused_ms) if refused_ms else None,
            "refused_status_ms_median": statistics.median(refused_ms) if refused_ms else None,
            "refused_status_ms_p99": (statistics.quantiles(refused_ms, n=100, method="inclusive")[98]
                                      if len(refused_ms) > 1 else (refused_ms or [None])[0]),
            "retry_after_s": sorted({r.retry_after_s for r in records if r.retry_after_s is not None})}


KEEP = ("requests", "completed", "errors", "refused", "best_effort", "attainment", "ttft_attainment",
        "admitted_attainment", "admitted_ttft_attainment", "goodput_tok_s", "throughput_tok_s", "duration_s",
        "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "tokens_per_step")


def slim(summary: dict, records: list[RequestRecord]) -> dict:
    """The figures this benchmark reports from one run's summary and records."""
    out = {k: summary.get(k) for k in KEEP}
    both = [r for r in records if r.ok and r.tpot_met and r.ttft_met]
    out["goodput_tpot_ttft_tok_s"] = (sum(r.completion_tokens for r in both) / summary["duration_s"]
                                      if summary["duration_s"] else None)
    out["categories"] = {c: {k: v.get(k) for k in ("requests", "attainment", "refused", "best_effort",
                                                   "admitted_attainment")}
                         for c, v in summary["categories"].items()}
    out["iteration_mean_ms"] = (summary.get("iteration") or {}).get("mean_ms")
    return out | account(records)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), s."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _poll(url: str, samples: list[tuple[float, float, float]], t0: float, stop: asyncio.Event) -> None:
    """(t, waiting, running) from the gateway's gauges every 0.25 s until `stop`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, OSError, ValueError, TimeoutError):
                m = await scrape(session, url)
                samples.append((time.perf_counter() - t0, m.get("vllm:num_requests_waiting", 0.0),
                                m.get("vllm:num_requests_running", 0.0)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)


async def _run(cfg: BenchConfig, poll: bool) -> tuple[dict, list[RequestRecord], list]:
    samples: list[tuple[float, float, float]] = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    poller = asyncio.create_task(_poll(cfg.url, samples, t0, stop)) if poll else None
    try:
        summary, records = await run_bench(cfg)
    finally:
        stop.set()
        if poller is not None:
            await poller
    return summary, records, samples


def run_point(stack: Stack, label: str, seed: int, poll: bool = False, **fields) -> dict:
    """One load point against a running stack: the bench's summary trimmed, the outcomes, the
    gateway's CPU share over the point, and (with `poll`) the gateway's queue over time."""
    runs = RESULTS / "runs"
    fields = {"mix": MIX} | fields
    cfg = BenchConfig(url=stack.url, out=str(runs / f"{label}.jsonl"), label=label, ignore_eos=True,
                      progress=False, seed=seed, timeout_s=900.0, **fields)
    pid = stack.gateway.proc.pid
    cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
    summary, records, samples = asyncio.run(_run(cfg, poll))
    wall = time.perf_counter() - wall0
    out = slim(summary, records) | {"label": label, "seed": seed,
                                    "gateway_cpu_share": (cpu_seconds(pid) - cpu0) / wall if wall else None}
    if poll:
        out["queue"] = [[round(t, 2), w, r] for t, w, r in samples]
    o = out["outcomes"]
    print(f"  {label}: attainment {_pct(out['attainment'])} admitted {_pct(out['admitted_attainment'])} "
          f"goodput {_f(out['goodput_tok_s'])} tok/s  " + " ".join(f"{k} {v}" for k, v in o.items()) +
          f"  gateway cpu {_f(out['gateway_cpu_share'], '.2f')}", file=sys.stderr, flush=True)
    return out


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _f(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def blocks_free(stack: Stack) -> list[dict]:
    """Every model service's block accounting after the run (releases are sent at the gateway's next
    iteration, so this waits up to 10 s for them): free == total and nothing resident means no leak."""

    async def one(proc) -> dict:
        client = await (TargetClient if proc.kind == "target" else DraftClient).connect(proc.address)
        try:
            for _ in range(100):
                s = await client.stats()
                if s.free_blocks == s.total_blocks and s.resident_requests == 0:
                    break
                await asyncio.sleep(0.1)
            return {"service": proc.kind, "free_blocks": s.free_blocks, "total_blocks": s.total_blocks,
                    "resident_requests": s.resident_requests}
        finally:
            await client.close()

    return [asyncio.run(one(p)) for p in stack.procs if p.kind in ("target", "draft")]


# ------------------------------------------------------------------------------------------ settings


def profile_for(args: argparse.Namespace) -> Path:
    """The real CPU stack uses the full sweep's profile (same SLO classes as the sweep); a simulated one
    gets its preset's profile, measured once into the results folder."""
    if args.profile:
        return Path(args.profile)
    if not args.simulate:
        return REAL_PROFILE
    path = RESULTS / f"profile-{args.simulate}.json"
    if not path.exists():
        measure_profile(path, 1, quick=True, simulate=args.simulate)
    return path


def gateway_args(args: argparse.Namespace, admission: str) -> list[str]:
    return [*ADMISSION_ARGS[admission], "--router", args.router, *args.gateway_args.split()]


def setting(args: argparse.Namespace) -> dict:
    return {"simulate": args.simulate, "targets": args.targets, "router": args.router, "policy": args.policy,
            "gateway_args": args.gateway_args.split(), "mix": getattr(args, "mix", MIX),
            "profile": str(profile_for(args))}


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    meta = machine_info() | {"argv": sys.argv[1:]}
    path.write_text(json.dumps(relative_paths({"meta": meta} | result), indent=1) + "\n")
    print(f"results: {path.relative_to(ROOT)}", file=sys.stderr)
    return path


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def stack_for(args: argparse.Namespace, admission: str) -> Stack:
    stack = Stack(args.policy, profile_for(args), args.threads, gateway_args(args, admission), args.simulate,
                  targets=args.targets)
    try:  # through every path before anything is timed; chat as flex, which SLO admission always serves
        asyncio.run(run_bench(BenchConfig(url=stack.url, out=str(RESULTS / "runs" / "warm-up.jsonl"), num_requests=4,
                                          max_tokens=8, seed=999, mix="flex=1:short", progress=False)))
    except BaseException:
        stack.stop()
        raise
    return stack


def n_for(rate: float, duration_s: float) -> int:
    return max(4, round(rate * duration_s))


# ------------------------------------------------------------------------------------------ target 1


def cmd_knee(args: argparse.Namespace) -> None:
    """FIFO attainment at each rate, lowest first; the knee is the lowest rate below 90%."""
    points = []
    with stack_for(args, "fifo") as stack:
        for i, rate in enumerate(sorted(args.rates)):
            p = run_point(stack, f"{_tagged('knee', args)}-fifo-rate{rate:g}", args.seed + i,
                          num_requests=n_for(rate, args.duration_s),
                          request_rate=rate)
            points.append({"rate": rate} | p)
            if p["attainment"] is not None and p["attainment"] < GOAL_ATTAINMENT and args.stop_early:
                break
    below = [p["rate"] for p in points if (p["attainment"] or 0.0) < GOAL_ATTAINMENT]
    knee = min(below) if below else None
    print(f"FIFO falls below 90% attainment at {knee} req/s", file=sys.stderr)
    save(_tagged("knee", args), {"setting": setting(args), "duration_s": args.duration_s, "points": points,
                                 "knee_rate": knee})


def cmd_overload(args: argparse.Namespace) -> None:
    """FIFO and SLO admission at the same rate (default 2x the knee), same seeds, fresh stacks per run,
    the order alternating between runs."""
    rate = args.rate
    if rate is None:
        knee = load(_tagged("knee", args))
        if not knee or knee.get("knee_rate") is None:
            raise SystemExit("overload: run `admission.py knee` first, or give --rate")
        rate = 2 * knee["knee_rate"]
    runs: list[dict] = []
    for run in range(args.runs):
        order = ("fifo", "slo") if run % 2 == 0 else ("slo", "fifo")
        for admission in order:
            with stack_for(args, admission) as stack:
                p = run_point(stack, f"{_tagged('overload', args)}-{admission}-run{run}", args.seed + 100 * run,
                              num_requests=n_for(rate, args.duration_s), request_rate=rate, mix=args.mix)
                p["blocks"] = blocks_free(stack)
            runs.append({"admission": admission, "run": run} | p)
    save(_tagged("overload", args), {"setting": setting(args), "rate": rate, "duration_s": args.duration_s,
                                     "runs": runs})


# ------------------------------------------------------------------------------------------ target 2


def cmd_capacity(args: argparse.Namespace) -> None:
    """The highest rate with >= 90% attainment: a coarse scan upwards (each rate x `--step`) to the first
    miss, then `--fine` bisection steps between the last pass and that miss, one stack throughout."""
    points: list[dict] = []

    def attain(stack: Stack, rate: float) -> bool:
        p = run_point(stack, f"capacity-{name}-rate{rate:.3g}", args.seed + len(points),
                      num_requests=n_for(rate, args.duration_s), request_rate=rate)
        points.append({"rate": rate} | p)
        return (p["attainment"] or 0.0) >= GOAL_ATTAINMENT

    name = args.name or capacity_name(args)
    with stack_for(args, args.admission) as stack:
        passed, failed = search_capacity(lambda rate: attain(stack, rate), args.start_rate, args.step, args.fine,
                                         args.min_rate, args.max_rate, args.budget_s)
        blocks = blocks_free(stack)
    print(f"capacity {name}: {passed} req/s (first miss {failed})", file=sys.stderr)
    save(f"capacity-{name}", {"setting": setting(args) | {"admission": args.admission},
                              "duration_s": args.duration_s, "points": points, "capacity_rate": passed,
                              "first_miss_rate": failed, "resolution": (failed - passed) if passed and failed else None,
                              "blocks": blocks})


def search_capacity(attains, start: float, step: float, fine: int, min_rate: float, max_rate: float,
                    budget_s: float, clock=time.monotonic) -> tuple[float | None, float | None]:
    """(highest rate that attained, lowest rate that missed) of a search by `attains(rate) -> bool`:
    upwards from `start` by x`step` to the first miss (downwards by /`step` to the first pass if `start`
    already misses), then `fine` bisection steps between the two; no new point after `budget_s`.
    None where no rate passed (or none missed) within the limits."""
    t0 = clock()
    passed: float | None = None
    failed: float | None = None
    rate = start
    while rate <= max_rate and clock() - t0 < budget_s:
        if attains(rate):
            passed, rate = rate, rate * step
        else:
            failed = rate
            break
    if passed is None and failed is not None:
        rate = failed / step
        while rate >= min_rate and clock() - t0 < budget_s:
            if attains(rate):
                passed = rate
                break
            failed, rate = rate, rate / step
    for _ in range(fine):
        if passed is None or failed is None or clock() - t0 >= budget_s:
            break
        mid = (passed + failed) / 2
        if attains(mid):
            passed = mid
        else:
            failed = mid
    return passed, failed


def capacity_name(args: argparse.Namespace) -> str:
    where = f"sim-{args.simulate}-x{args.targets}" if args.simulate else f"real-x{args.targets}"
    return _tagged(f"{where}-{args.admission}-{args.router}", args)


def _tagged(name: str, args: argparse.Namespace) -> str:
    return f"{name}-{args.tag}" if getattr(args, "tag", "") else name


# ------------------------------------------------------------------------------------------ target 3


def cmd_burst(args: argparse.Namespace) -> None:
    """`--before-s` at the sustainable rate, `--burst-s` at `--factor` x it, `--after-s` back at it; the
    gateway's queue is polled throughout; then every service's blocks are read."""
    rate = args.rate
    if rate is None:
        knee = load(_tagged("knee", args))
        if not knee:
            raise SystemExit("burst: run `admission.py knee` first, or give --rate")
        ok = [p["rate"] for p in knee["points"] if (p["attainment"] or 0.0) >= GOAL_ATTAINMENT]
        if not ok:
            raise SystemExit("burst: no knee rate met 90% attainment; give --rate")
        rate = max(ok)
    schedule = f"{args.before_s:g}:{rate:g},{args.burst_s:g}:{args.factor * rate:g},{args.after_s:g}:{rate:g}"
    runs = []
    for run in range(args.runs):
        order = ("fifo", "slo") if run % 2 == 0 else ("slo", "fifo")
        for admission in order:
            with stack_for(args, admission) as stack:
                p = run_point(stack, f"{_tagged('burst', args)}-{admission}-run{run}", args.seed + 100 * run, poll=True,
                              rate_schedule=schedule, burstiness=args.burstiness)
                p["blocks"] = blocks_free(stack)
            p["drain"] = drain(p["queue"], args.before_s, args.before_s + args.burst_s)
            runs.append({"admission": admission, "run": run} | p)
            print(f"  drain: {p['drain']}", file=sys.stderr)
    save(_tagged("burst", args), {"setting": setting(args), "rate": rate, "schedule": schedule, "factor": args.factor,
                   "burstiness": args.burstiness, "runs": runs})


SPIKE_MIX = "critical=1:short"


def cmd_spike(args: argparse.Namespace) -> None:
    """`--requests` critical requests sent at once (short prompts), FIFO and SLO admission in turn per
    run on fresh stacks: how each ended, how fast the refusals came, and every service's blocks after."""
    runs = []
    for run in range(args.runs):
        order = ("fifo", "slo") if run % 2 == 0 else ("slo", "fifo")
        for admission in (a for a in order if a in args.admissions):
            with stack_for(args, admission) as stack:
                p = run_point(stack, f"{_tagged('spike', args)}-{admission}-run{run}", args.seed + 100 * run,
                              poll=True, num_requests=args.requests, mix=SPIKE_MIX)
                p["blocks"] = blocks_free(stack)
            runs.append({"admission": admission, "run": run} | p)
            print(f"  blocks: {p['blocks']}", file=sys.stderr)
    save(_tagged("spike", args), {"setting": setting(args) | {"mix": SPIKE_MIX}, "requests": args.requests,
                                  "runs": runs})


def drain(queue: list[list[float]], burst_start: float, burst_end: float) -> dict:
    """From (t, waiting, running) samples: the queue's peak, and the seconds after the burst's end until
    nothing waits and no more run than at most before the burst (None: not within the run)."""
    before = [r for t, w, r in queue if t < burst_start]
    base_running = max(before) if before else 0.0
    peak_waiting = max((w for t, w, r in queue if t >= burst_start), default=0.0)
    peak_running = max((r for t, w, r in queue if t >= burst_start), default=0.0)
    waiting_zero = next((t - burst_end for t, w, r in queue if t >= burst_end and w == 0), None)
    settled = next((t - burst_end for t, w, r in queue if t >= burst_end and w == 0 and r <= base_running), None)
    return {"peak_waiting": peak_waiting, "peak_running": peak_running, "running_before_max": base_running,
            "waiting_empty_after_s": waiting_zero, "settled_after_s": settled}


# ------------------------------------------------------------------------------------------ main


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser, duration_s: float) -> None:
        p.add_argument("--simulate", default=None, metavar="PRESET", help="simulated model services")
        p.add_argument("--targets", type=int, default=1, help="target replicas")
        p.add_argument("--router", default="round-robin", help="the gateway's --router")
        p.add_argument("--policy", default="none", help="speculation policy of every gateway")
        p.add_argument("--gateway-args", default="", help="more flags for every gateway")
        p.add_argument("--profile", default=None, help="profile file (default: the full sweep's, or the preset's)")
        p.add_argument("--threads", type=int, default=1, help="torch threads per model service")
        p.add_argument("--duration-s", type=float, default=duration_s, help="seconds of arrivals per point")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--tag", default="", help="names a result set (knee-TAG.json, ...), e.g. for other SLO classes")

    p = sub.add_parser("knee", help="target 1a: FIFO attainment vs rate")
    common(p, 40.0)
    p.add_argument("--rates", type=_floats, default=[0.2, 0.3, 0.4, 0.5, 0.6])
    p.add_argument("--stop-early", action="store_true", help="stop at the first rate below 90%%")
    p.set_defaults(fn=cmd_knee)
    p = sub.add_parser("overload", help="target 1b: FIFO and SLO admission at 2x the knee")
    common(p, 45.0)
    p.add_argument("--rate", type=float, default=None, help="default: 2x knee.json's knee")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mix", default=MIX, help="the bench's --mix (e.g. flex=1:short: no request with an SLO)")
    p.set_defaults(fn=cmd_overload)
    p = sub.add_parser("capacity", help="target 2: the highest rate with >= 90%% attainment")
    common(p, 30.0)
    p.add_argument("--admission", choices=tuple(ADMISSION_ARGS), required=True)
    p.add_argument("--start-rate", type=float, required=True)
    p.add_argument("--step", type=float, default=1.5, help="coarse scan factor")
    p.add_argument("--fine", type=int, default=2, help="bisection steps after the coarse scan")
    p.add_argument("--min-rate", type=float, default=0.05)
    p.add_argument("--max-rate", type=float, default=200.0)
    p.add_argument("--budget-s", type=float, default=780.0, help="stop searching after this many seconds")
    p.add_argument("--name", default=None)
    p.set_defaults(fn=cmd_capacity)
    p = sub.add_parser("burst", help="target 3: a burst of 3x the sustainable rate")
    common(p, 0.0)
    p.add_argument("--rate", type=float, default=None, help="the sustainable rate (default: knee.json's last pass)")
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--before-s", type=float, default=20.0)
    p.add_argument("--burst-s", type=float, default=10.0)
    p.add_argument("--after-s", type=float, default=30.0)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=1)
    p.set_defaults(fn=cmd_burst)
    p = sub.add_parser("spike", help="issue 30's burst: N critical requests at once")
    common(p, 0.0)
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--admissions", type=lambda s: s.split(","), default=["fifo", "slo"],
                   help="which admissions to run, comma-separated (default fifo,slo)")
    p.set_defaults(fn=cmd_spike)
    p = sub.add_parser("report", help="regenerate docs/lab/admission.md's section from the results")
    p.add_argument("--docs", default=str(ROOT / "docs" / "lab" / "admission.md"))
    p.set_defaults(fn=cmd_report)
    args = ap.parse_args(argv)
    for name in ("targets", "runs", "fine"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < (0 if name == "fine" else 1):
            ap.error(f"--{name} must be >= {0 if name == 'fine' else 1}")
    for name in ("rate", "start_rate", "duration_s"):
        v = getattr(args, name, None)
        unused = name == "duration_s" and args.cmd in ("burst", "spike")
        if v is not None and not (v > 0 and math.isfinite(v)) and not unused:
            ap.error(f"--{name.replace('_', '-')} must be a positive number")
    try:
        args.fn(args)
    except (RuntimeError, ValueError, ConnectionError, OSError) as exc:
        print(f"admission: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_report(args: argparse.Namespace) -> None:
    write_docs(Path(args.docs), markdown(RESULTS))


# ------------------------------------------------------------------------------------------ report


def _agg(values: list) -> str:
    """median (min-max) of the values that are not None, as numbers formatted by the caller's scale."""
    xs = [v for v in values if v is not None]
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.2f}" + (f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else "")


def _aggp(values: list) -> str:
    xs = [100 * v for v in values if v is not None]
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.0f}" + (f" ({min(xs):.0f}-{max(xs):.0f})" if len(xs) > 1 else "")


def _blocks_ok(blocks: list[dict]) -> bool:
    return all(b["free_blocks"] == b["total_blocks"] and b["resident_requests"] == 0 for b in blocks)


def _classes(setting: dict) -> str:
    args = setting.get("gateway_args") or []
    given = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--slo-class"]
    return ", ".join(given) if given else "the profile's (critical / search / chat = 1.0x / 2.4x / 8x the baseline)"


def _sim_label(setting: dict) -> str:
    sim = setting.get("simulate")
    return f"SIMULATED, preset `{sim}` (sources: shared/simulate/presets/{sim}.toml)" if sim else "real CPU stack"


def markdown(results: Path) -> str:
    out: list[str] = []
    tags = sorted({p.stem.removeprefix(n).removeprefix("-") for n in ("knee", "overload", "burst")
                   for p in results.glob(f"{n}*.json")})
    for tag in tags:
        knee, over = (_read(results / f"{n}{'-' + tag if tag else ''}.json") for n in ("knee", "overload"))
        if knee or over:
            classes = _classes((knee or over or {}).get("setting", {}))
            out += [f"**SLO classes{' `' + tag + '`' if tag else ''}: {classes}.**", ""]
        out += _knee_md(knee) + _overload_md(over)
    caps = sorted(results.glob("capacity-*.json"))
    if caps:
        out += _capacity_md(caps)
    for tag in tags:
        out += _burst_md(_read(results / f"burst{'-' + tag if tag else ''}.json"))
    return "\n".join(out)


def _knee_md(knee: dict | None) -> list[str]:
    if not knee:
        return []
    out = ["#### Target 1a: where FIFO admission falls below 90% attainment (one real CPU replica)", "",
           f"`bench/admission.py knee`, {knee['meta']['date']}; policy "
           f"`{knee['setting']['policy']}`, {knee['duration_s']:g} s of Poisson arrivals per rate, one run.", "",
           "| rate (req/s) | requests | attainment % | goodput tok/s | TPOT p50 ms | TTFT p50 ms |",
           "|---:|---:|---:|---:|---:|---:|"]
    for p in knee["points"]:
        out.append(f"| {p['rate']:g} | {p['requests']} | {_aggp([p['attainment']])} | "
                   f"{_agg([p['goodput_tok_s']])} | {_agg([p['tpot_p50_ms']])} | {_agg([p['ttft_p50_ms']])} |")
    return out + ["", f"Knee: **{knee['knee_rate']} req/s** (the lowest rate scanned below 90%).", ""]


def _overload_md(over: dict | None) -> list[str]:
    if not over:
        return []
    by = {a: sorted((r for r in over["runs"] if r["admission"] == a), key=lambda r: r["run"]) for a in ("fifo", "slo")}
    out = [f"#### Target 1b: FIFO and SLO admission at {over['rate']:g} req/s (2x the knee), one real CPU replica",
           "", f"`bench/admission.py overload`, {over['meta']['date']}; "
           f"{len(by['fifo'])} runs, each {over['duration_s']:g} s of Poisson arrivals, the same seeds for both, "
           "fresh services per run, order alternating; median (min-max) over runs.", "",
           "| | FIFO | SLO admission |", "|---|---:|---:|"]
    for name, key, fmt in (("attainment % (all requests; refused = missed)", "attainment", _aggp),
                           ("admitted requests' TPOT attainment %", "admitted_attainment", _aggp),
                           ("admitted requests' TTFT attainment %", "admitted_ttft_attainment", _aggp),
                           ("goodput tok/s (TPOT met)", "goodput_tok_s", _agg),
                           ("goodput tok/s (TPOT and TTFT met)", "goodput_tpot_ttft_tok_s", _agg),
                           ("throughput tok/s", "throughput_tok_s", _agg),
                           ("TTFT p99 ms", "ttft_p99_ms", _agg),
                           ("run duration s (first send to last token)", "duration_s", _agg)):
        out.append(f"| {name} | {fmt([r[key] for r in by['fifo']])} | {fmt([r[key] for r in by['slo']])} |")
    for o in OUTCOMES:
        out.append(f"| requests {o} (sum over runs) | {sum(r['outcomes'][o] for r in by['fifo'])} | "
                   f"{sum(r['outcomes'][o] for r in by['slo'])} |")
    refusal = [r["refused_status_ms_max"] for r in by["slo"] if r["refused_status_ms_max"] is not None]
    out.append(f"| slowest refusal (503 status after send), ms | - | {max(refusal):.0f} |" if refusal else
               "| slowest refusal, ms | - | - |")
    out.append(f"| every block free at the end | {all(_blocks_ok(r['blocks']) for r in by['fifo'])} | "
               f"{all(_blocks_ok(r['blocks']) for r in by['slo'])} |")
    ratios = [s["goodput_tok_s"] / f["goodput_tok_s"] for f, s in zip(by["fifo"], by["slo"])
              if f["goodput_tok_s"] and s["goodput_tok_s"] is not None]
    if ratios:
        out += ["", f"Goodput SLO / FIFO per run (same seeds): {', '.join(f'{x:.2f}x' for x in ratios)}; lowest "
                f"{min(ratios):.2f}x, median {statistics.median(ratios):.2f}x."]
    return out + [""]


def _capacity_md(caps: list[Path]) -> list[str]:
    out = ["#### Target 2: serving capacity (highest rate with >= 90% attainment)", "",
           "`bench/admission.py capacity`: a coarse scan upwards (x1.5 per step) to the first miss, then "
           "bisection; one run per rate, so a point's attainment carries the run-to-run noise of that one "
           "run. The resolution is the gap between the capacity and the lowest rate that missed.", "",
           "| setting | SLO classes (TPOT ms : TTFT ms) | admission | router | capacity req/s | first miss | "
           "points (rate: attainment %) | gateway CPU (cores) at capacity | blocks free |",
           "|---|---|---|---|---:|---:|---|---:|---|"]
    sims: set[str] = set()
    for path in caps:
        c = _read(path)
        assert c is not None
        st = c["setting"]
        pts = ", ".join(f"{p['rate']:.3g}: {_aggp([p['attainment']])}" for p in c["points"])
        at = next((p for p in c["points"] if p["rate"] == c["capacity_rate"]), None)
        cpu = f"{at['gateway_cpu_share']:.2f}" if at and at.get("gateway_cpu_share") is not None else "-"
        where = (f"SIMULATED `{st['simulate']}`, {st['targets']} replicas" if st.get("simulate")
                 else f"real CPU, {st['targets']} replica")
        if st.get("simulate"):
            sims.add(st["simulate"])
        cap = "-" if c["capacity_rate"] is None else f"{c['capacity_rate']:.3g}"
        miss = "-" if c["first_miss_rate"] is None else f"{c['first_miss_rate']:.3g}"
        out.append(f"| {where} | {_classes(st)} | {st['admission']} | {st['router']} | {cap} | {miss} | {pts} | "
                   f"{cpu} | {_blocks_ok(c['blocks'])} |")
    return out + [""] + [f"Simulated rows: {_sim_label({'simulate': sim})}." for sim in sorted(sims)] + [""]


def _burst_md(burst: dict | None) -> list[str]:
    if not burst:
        return []
    out = [f"#### Target 3: a burst ({burst['factor']:g}x the sustainable {burst['rate']:g} req/s), "
           f"{_sim_label(burst['setting'])}; SLO classes: {_classes(burst['setting'])}", "",
           f"`bench/admission.py burst`, {burst['meta']['date']}: rate "
           f"schedule `{burst['schedule']}` (SECONDS:RATE segments, gamma shape {burst['burstiness']:g}); the "
           "gateway's `vllm:num_requests_waiting` / `running` polled every 0.25 s. Drain: seconds after the "
           "burst's end until nothing waits (and, settled, no more run than before the burst).", "",
           "| admission | run | requests | refused (503 + Retry-After) | best effort | attainment of the rest "
           "% (TPOT) | TTFT % | peak waiting | waiting empty after s | settled after s | failed | blocks free |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in burst["runs"]:
        d = r["drain"]
        out.append(f"| {r['admission']} | {r['run']} | {r['requests']} | {r['outcomes']['refused']} | "
                   f"{r['outcomes']['best_effort']} | {_aggp([r['admitted_attainment']])} | "
                   f"{_aggp([r['admitted_ttft_attainment']])} | {d['peak_waiting']:.0f} | "
                   f"{_agg([d['waiting_empty_after_s']])} | {_agg([d['settled_after_s']])} | "
                   f"{r['outcomes']['failed']} | {_blocks_ok(r['blocks'])} |")
    return out + [""]


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


BEGIN, END = "<!-- admission:begin -->", "<!-- admission:end -->"


def write_docs(docs: Path, body: str) -> None:
    """Replace the generated section between the markers (text around it kept), or append it."""
    text = docs.read_text() if docs.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in text and END in text:
        a, rest = text.split(BEGIN, 1)
        text = a + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n### Generated: SLO-aware admission (`bench/admission.py`)\n\n" + block + "\n"
    docs.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
