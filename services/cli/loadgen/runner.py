"""`specserve bench`: stream a timed request mix at a running gateway and report SLO attainment and goodput.

    specserve bench --url http://127.0.0.1:8000 --request-rate 4 --num-requests 200 --ignore-eos

Requests arrive by a Poisson process (`--burstiness 1`), a burstier gamma process (`--burstiness
< 1`), a piecewise-constant rate (`--rate-schedule`, e.g. a burst), or at the times of a trace file
(`--trace`, rescaled to `--request-rate` if given). Each one
is a streamed /v1/completions call with its category's `service_tier` (and `slo`, if the mix gives
a TPOT). The output is a JSONL of per-request records, a JSON summary beside it, and a table on
stdout; the summary also carries the server's iteration split read from /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import aiohttp
import msgspec

from specserve.cli.loadgen.arrivals import (
    gamma_arrivals,
    load_trace,
    parse_rate_schedule,
    piecewise_arrivals,
    trace_arrivals,
)
from specserve.cli.loadgen.client import send
from specserve.cli.loadgen.records import RequestRecord, summarize
from specserve.cli.loadgen.scrape import PARTS, scrape, server_delta
from specserve.cli.loadgen.workload import DEFAULT_MIX, BenchRequest, build_requests, parse_mix
from specserve.gateway.sched.slo_classes import ALIASES
from specserve.shared.process.ports import GATEWAY_URL
from specserve.shared.process.settings import Settings, option


@dataclass(slots=True, kw_only=True)
class BenchConfig(Settings):
    """`specserve bench`'s settings: each one a flag and a SPECSERVE_BENCH_* variable (shared/process/settings.py)."""

    env_prefix: ClassVar[str] = "SPECSERVE_BENCH_"

    url: str = option(GATEWAY_URL, "the gateway's base URL (without /v1)")
    model: str | None = option(None, "model id to send", default_text="the server's first model")
    num_requests: int = option(100, "requests to send", aliases=("-n",))
    request_rate: float = option(math.inf, "requests/s (inf: all at once)")
    burstiness: float = option(1.0, "gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    trace: str | None = option(None, "replay arrival timestamps from this file (one per line, or JSONL with "
                               "'timestamp'); rescaled to --request-rate when that is given")
    rate_schedule: str | None = option(None, "a piecewise-constant rate instead of --request-rate, e.g. "
                                       "20:0.5,10:1.5,30:0.5 (a burst); gaps within a segment follow --burstiness; "
                                       "the request count follows from the schedule", metavar="SECONDS:RATE,...")
    max_concurrency: int | None = option(None, "most requests in flight", default_text="no limit")
    mix: str = option(DEFAULT_MIX, "categories TIER=SHARE:WORKLOAD[:TPOT_MS],...")
    max_tokens: int | None = option(None, "override each prompt's max_tokens", default_text="the prompt's")
    ignore_eos: bool = option(False, "generate exactly max_tokens (vLLM's ignore_eos)")
    best_effort: bool = option(False, "every request allows best effort when no replica can meet its SLO "
                               "(gateway --admission slo)")
    sequential_prompts: bool = option(False, "take each category's prompts in file order (cycling) instead of "
                                      "at random")
    seed: int = option(0, "seeds arrivals, category order and prompt choice")
    out: str | None = option(None, "per-request JSONL; the summary goes beside it (.summary.json)",
                             default_text="specserve-bench-<time>.jsonl")
    label: str | None = option(None, "names the run in the summary", default_text="the server's policy")
    timeout_s: float = option(600.0, "per-request timeout, s")
    progress: bool = option(True, "no progress bar", negate=True)


def add_flags(p: argparse.ArgumentParser) -> None:
    BenchConfig.add_flags(p)


def arrival_times(cfg: BenchConfig) -> list[float]:
    if cfg.rate_schedule is not None:
        if cfg.trace is not None:
            raise ValueError("--rate-schedule and --trace are exclusive")
        times = piecewise_arrivals(parse_rate_schedule(cfg.rate_schedule), cfg.burstiness, cfg.seed)
        if not times:
            raise ValueError(f"the rate schedule {cfg.rate_schedule!r} gives no request (raise a rate or a duration)")
        return times
    if cfg.trace is not None:
        rate = None if math.isinf(cfg.request_rate) else cfg.request_rate
        return trace_arrivals(load_trace(cfg.trace), cfg.num_requests, rate)
    return gamma_arrivals(cfg.num_requests, cfg.request_rate, cfg.burstiness, cfg.seed)


def summary_path(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".jsonl") + ".summary.json")


async def _server_info(session: aiohttp.ClientSession, url: str) -> tuple[dict, list[str]]:
    async with session.get(f"{url}/v1/slo_classes") as resp:
        resp.raise_for_status()
        info = await resp.json()
    async with session.get(f"{url}/v1/models") as resp:
        resp.raise_for_status()
        models = [m["id"] for m in (await resp.json())["data"]]
    return info, models


async def run_bench(cfg: BenchConfig) -> tuple[dict, list[RequestRecord]]:
    """Run the benchmark; returns (summary, records) and writes both if `cfg.out` is set."""
    if cfg.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    categories = parse_mix(cfg.mix)
    times = arrival_times(cfg)
    n = len(times) if cfg.rate_schedule is not None else cfg.num_requests  # a schedule sets the count
    requests = build_requests(categories, n, cfg.seed, cfg.max_tokens, sequential=cfg.sequential_prompts)
    url = cfg.url.rstrip("/").removesuffix("/v1")
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # concurrency is ours to limit, not the pool's
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        try:
            info, models = await _server_info(session, url)
        except (aiohttp.ClientError, OSError) as exc:
            raise ConnectionError(f"no specserve gateway answers at {url}: {exc}") from None
        classes = info["classes"]
        unknown = sorted({c.tier for c in categories} - set(classes) - set(ALIASES))  # aliases: as the server
        if unknown:
            raise ValueError(f"the server has no SLO class {', '.join(unknown)} (it has {', '.join(classes)})")
        model = cfg.model or models[0]
        records = [_record(r, classes, t) for r, t in zip(requests, times)]
        before = await scrape(session, url)
        summary_server, duration = await _drive(session, url, model, cfg, requests, records, times)
        after = await scrape(session, url)
    summary = summarize(records, duration, server_delta(before, after))
    summary["label"] = cfg.label or (info.get("policy") or {}).get("name")  # the policy's name, not its dict
    summary["policy"] = info.get("policy")
    summary["server"] = {"budget_tokens": info.get("budget_tokens"),
                         "baseline_iteration_ms": info.get("baseline_iteration_ms"),
                         "classes": classes} | summary_server
    summary["config"] = asdict(cfg) | {"request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate}
    if cfg.out:
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in records))
        summary_path(out).write_text(json.dumps(summary, indent=1) + "\n")
    return summary, records


def _record(req: BenchRequest, classes: dict, scheduled: float) -> RequestRecord:
    cls = classes[ALIASES.get(req.category, req.category)]  # the class the server resolves the tier to
    return RequestRecord(index=req.index, category=req.category, workload=req.workload, prompt_id=req.prompt_id,
                         slo_tpot_ms=req.tpot_ms or cls["tpot_ms"], slo_ttft_ms=cls["ttft_ms"],
                         scheduled_s=scheduled, sent_s=scheduled, max_tokens=req.max_tokens)


async def _drive(session: aiohttp.ClientSession, url: str, model: str, cfg: BenchConfig, requests: list[BenchRequest],
                 records: list[RequestRecord], times: list[float]) -> tuple[dict, float]:
    from tqdm import tqdm

    endpoint = f"{url}/v1/completions"
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not cfg.progress, file=sys.stderr,
               dynamic_ncols=True)
    met = errors = 0
    end = 0.0
    t_start = time.perf_counter()

    async def one(req: BenchRequest, record: RequestRecord, at: float) -> None:
        nonlocal met, errors, end
        delay = t_start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is not None:
            async with limit:
                await send(session, endpoint, req, record, model, cfg.ignore_eos, t_start, cfg.best_effort)
        else:
            await send(session, endpoint, req, record, model, cfg.ignore_eos, t_start, cfg.best_effort)
        end = max(end, time.perf_counter())
        met += record.slo_met
        errors += not record.ok
        bar.update(1)
        bar.set_postfix(slo_met=f"{met}/{bar.n}", errors=errors, refresh=False)

    try:
        await asyncio.gather(*(one(r, rec, t) for r, rec, t in zip(requests, records, times)))
    finally:
        bar.close()
    first = min(r.sent_s for r in records)
    return {"offered_rate": (len(times) - 1) / times[-1] if times[-1] > 0 else None}, (end - t_start) - first


def format_summary(s: dict) -> str:
    """The summary as a small plain-text report (overall, then per category, then the iteration split)."""

    def f(v: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
        return "-" if v is None else format(v * scale, spec)

    policy = s.get("policy")
    policy = policy.get("name") if isinstance(policy, dict) else policy
    lines = [f"label {s.get('label')}  policy {policy}  requests {s['requests']}  "
             f"completed {s['completed']}  errors {s['errors']}  duration {s['duration_s']:.1f} s",
             f"SLO attainment {f(s['attainment'], '.1f', 100)} % (TTFT and TPOT; TPOT alone "
             f"{f(s['tpot_attainment'], '.1f', 100)} %, TTFT alone {f(s['ttft_attainment'], '.1f', 100)} %)   "
             f"goodput {f(s['goodput_tok_s'])} tok/s   throughput {f(s['throughput_tok_s'])} tok/s",
             f"TTFT p50 {f(s['ttft_p50_ms'])} ms  p99 {f(s['ttft_p99_ms'])} ms   "
             f"TPOT p50 {f(s['tpot_p50_ms'], '.2f')} ms  p99 {f(s['tpot_p99_ms'], '.2f')} ms   "
             f"tokens/step {f(s['tokens_per_step'], '.2f')}   acceptance {f(s.get('acceptance_rate'), '.2f')}",
             "",
             f"{'category':<10} {'SLO ms':>7} {'n':>5} {'attain %':>9} {'goodput':>9} {'TPOT p50':>9} "
             f"{'TTFT p50':>9} {'tok/step':>8}"]
    for name, c in s["categories"].items():
        lines.append(f"{name:<10} {c['slo_tpot_ms']:>7.1f} {c['requests']:>5} {f(c['attainment'], '.1f', 100):>9} "
                     f"{f(c['goodput_tok_s']):>9} {f(c['tpot_p50_ms'], '.2f'):>9} {f(c['ttft_p50_ms']):>9} "
                     f"{f(c['tokens_per_step'], '.2f'):>8}")
    it = s.get("iteration")
    if it and it["iterations"]:
        shares = "  ".join(f"{p} {f(it['share'][p], '.1f', 100)} %" for p in PARTS)
        lines += ["", f"iterations {it['iterations']}  mean {f(it['mean_ms'], '.2f')} ms   {shares}"]
    for kind, n in s.get("error_kinds", {}).items():
        lines.append(f"error x{n}: {kind}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    cfg = BenchConfig.from_args(args)
    if cfg.out is None:
        cfg.out = time.strftime("specserve-bench-%Y%m%d-%H%M%S.jsonl")
    try:
        summary, _ = asyncio.run(run_bench(cfg))
    except (ValueError, ConnectionError, OSError) as exc:
        print(f"specserve bench: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(f"\nrecords: {cfg.out}\nsummary: {summary_path(Path(cfg.out))}")
    return 0 if summary["completed"] else 1
