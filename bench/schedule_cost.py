"""The gateway's own time per iteration (the `schedule` share of /metrics), this checkout against an
earlier one, side by side in one run.

For each run, each version (the order alternates by run, so drift hits both alike) and each policy,
a fresh target, draft and gateway of that version serve `batch` concurrent streams of
`--tokens` tokens (ignore_eos, short prompts), once per batch size. The gateway's counters before
and after give the mean scheduling time per iteration (`specserve:iteration_schedule_seconds_total`
/ `specserve:iterations_total`) and its share of the iteration. Medians and min-max over runs go to
bench/results/schedule_cost.json and a markdown table on stdout.

The earlier version runs from a checkout given by --baseline (e.g. `git worktree add /tmp/base
de77309`); its packages are put first on PYTHONPATH through a symlink tree, so both versions share
this venv.

--tracing adds a third version: this checkout with tracing on (OTEL_EXPORTER_OTLP_ENDPOINT set for
all three processes, every span sampled and exported over OTLP/HTTP to a sink in this process that
answers 200 and counts what it got). The other two run with no OTEL endpoint, i.e. tracing off.

    .venv/bin/python bench/schedule_cost.py --baseline /tmp/base --runs 3 [--tracing]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.sweep import relative_paths  # noqa: E402
from specserve.cli.loadgen.scrape import parse_counters  # noqa: E402
from specserve.shared.host.launch import ServiceProcess  # noqa: E402

PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def package_tree(checkout: Path) -> Path:
    """A directory whose `specserve` package is that checkout's services/ plus shared/ (symlinks)."""
    top = Path(tempfile.mkdtemp(prefix="specserve-pkg-"))
    pkg = top / "specserve"
    pkg.mkdir()
    for entry in (checkout / "services").iterdir():
        (pkg / entry.name).symlink_to(entry)
    (pkg / "shared").symlink_to(checkout / "shared")
    return top


OTEL_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class OtlpSink:
    """Accepts OTLP/HTTP exports (any POST) with 200 and counts them; a thread of this process."""

    def __init__(self) -> None:
        counts = self.counts = {"posts": 0, "bytes": 0}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                n = int(self.headers.get("Content-Length", 0))
                self.rfile.read(n)
                counts["posts"] += 1
                counts["bytes"] += n
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Stack:
    def __init__(self, pythonpath: str | None, policy: str, profile: str, gateway_args: list[str],
                 otlp_endpoint: str | None = None):
        old = {name: os.environ.get(name) for name in ("PYTHONPATH", *OTEL_ENDPOINTS)}
        if pythonpath:
            os.environ["PYTHONPATH"] = pythonpath
        for name in OTEL_ENDPOINTS:  # tracing off unless this stack is the traced one
            os.environ.pop(name, None)
        if otlp_endpoint:
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
        try:
            self.target = ServiceProcess("target", threads=1)
            self.draft = ServiceProcess("draft", threads=1)
            self.gateway = ServiceProcess("gateway", "--draft", self.draft.address, "--target", self.target.address,
                                          "--policy", policy, "--profile", profile, *gateway_args)
        finally:
            for name, value in old.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self.url = self.gateway.address

    def stop(self) -> None:
        for p in (self.gateway, self.draft, self.target):
            p.stop()


async def counter_deltas(url: str, tokens: int, requests: int, at_once: bool) -> dict[str, float]:
    """The gateway's /metrics counters' growth over `requests` streamed greedy requests of `tokens`
    tokens, all at once or one after another, after one warm-up request outside the window."""
    async with aiohttp.ClientSession() as s:
        async def metrics() -> dict[str, float]:
            async with s.get(f"{url}/metrics") as r:
                return parse_counters(await r.text())

        async def one() -> None:
            body = {"model": "target", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for _ in r.content:
                    pass

        await one()  # warm-up, outside the counted window
        before = await metrics()
        if at_once:
            await asyncio.gather(*(one() for _ in range(requests)))
        else:
            for _ in range(requests):
                await one()
        after = await metrics()
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


async def load(url: str, batch: int, tokens: int) -> dict[str, float]:
    d = await counter_deltas(url, tokens, batch, at_once=True)
    parts = [d.get(f"specserve:iteration_{p}_seconds_total", 0.0) for p in ("draft", "target", "transport",
                                                                            "schedule")]
    iters = d.get("specserve:iterations_total", 0.0)
    sched = d.get("specserve:iteration_schedule_seconds_total", 0.0)
    return {"iterations": iters, "schedule_ms": sched / iters * 1e3 if iters else float("nan"),
            "iteration_ms": sum(parts) / iters * 1e3 if iters else float("nan"),
            "schedule_share": sched / sum(parts) if sum(parts) else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a checkout of the earlier version")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--policies", default="adaserve,none")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--profile", default=str(ROOT / "bench/results/sweep-full/profile.json"))
    ap.add_argument("--gateway-args", default="--budget 16")
    ap.add_argument("--out", default=str(ROOT / "bench/results/schedule_cost.json"))
    ap.add_argument("--tracing", action="store_true", help="also run this checkout with tracing on")
    args = ap.parse_args()
    base = str(package_tree(Path(args.baseline).resolve()))
    base_rev = subprocess.run(["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    head_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    sink = OtlpSink() if args.tracing else None
    after = f"after ({head_rev}+)" + (", tracing off" if sink else "")
    versions: dict[str, str | None] = {f"before ({base_rev})": base, after: None}
    traced = f"after ({head_rev}+), tracing on"
    if sink is not None:
        versions[traced] = None
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict] = []
    for run in range(args.runs):
        order = list(versions) if run % 2 == 0 else list(reversed(versions))
        for version in order:
            for policy in args.policies.split(","):
                stack = Stack(versions[version], policy, args.profile, args.gateway_args.split(),
                              sink.url if sink is not None and version == traced else None)
                try:
                    for batch in batches:
                        t0 = time.perf_counter()
                        r = asyncio.run(load(stack.url, batch, args.tokens))
                        rows.append({"run": run, "version": version, "policy": policy, "batch": batch, **r})
                        print(f"run {run} {version} {policy} batch {batch}: {r['schedule_ms']:.3f} ms/iteration "
                              f"({r['schedule_share']:.1%}), {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                              flush=True)
                finally:
                    stack.stop()
    summary = []
    for policy in args.policies.split(","):
        for batch in batches:
            for version in versions:
                got = [r for r in rows if (r["policy"], r["batch"], r["version"]) == (policy, batch, version)]
                ms = [r["schedule_ms"] for r in got]
                share = [r["schedule_share"] for r in got]
                summary.append({"policy": policy, "batch": batch, "version": version,
                                "schedule_ms": statistics.median(ms), "min": min(ms), "max": max(ms),
                                "share": statistics.median(share),
                                "iteration_ms": statistics.median(r["iteration_ms"] for r in got)})
    run_args = relative_paths(vars(args) | {"baseline": f"a checkout of {base_rev}"})  # no machine paths
    exported = sink.counts if sink is not None else None  # what the traced stacks sent, all runs together
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary, "args": run_args,
                                          "otlp_exported": exported}, indent=1))
    print("| policy | batch | version | schedule ms / iteration, median (min-max) | share of iteration | "
          "iteration ms |")
    print("|---|---:|---|---:|---:|---:|")
    for s in summary:
        print(f"| {s['policy']} | {s['batch']} | {s['version']} | {s['schedule_ms']:.3f} ({s['min']:.3f}-"
              f"{s['max']:.3f}) | {s['share']:.1%} | {s['iteration_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
