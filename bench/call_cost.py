"""Transport + scheduling per iteration at one request: Unix sockets against TCP, this checkout
against an earlier one, side by side in one run (issue 17, "cheaper calls").

For each round, each version and each socket kind (the order alternates by round, so drift hits
all alike), a fresh target and draft of that version (one torch thread each, bundled pair, float32)
listen on loopback TCP or on Unix sockets in a private directory (`ServiceProcess(unix=True)`, what
`specserve up` does), and the later version once more on Unix sockets with `--inline-tokens 0`
(every model call on the model thread, as before); then per policy a gateway of that version
serves `--requests` streamed requests of `--tokens` tokens one after another (ignore_eos, one
short prompt), after one warm-up request. The gateway's counters before and after give, per engine
iteration, the mean of its four time shares (docs/architecture.md, "The iteration record"): transport (the calls' time
beyond the services' own `total_ms`) and schedule (everything outside the calls). Medians and
min-max over rounds go to bench/results/call_cost.json and a markdown table on stdout.

The earlier version runs from a checkout given by --baseline (e.g. `git archive ce10816 services
shared | tar -x -C /tmp/base`, with a `models` link to this checkout's); its packages are put first
on PYTHONPATH through a symlink tree, so both versions share this venv. Its services take
`--unix-socket` too, so its Unix row isolates the socket kind from the code changes. `--checkout`
runs the later version from a frozen copy the same way.

    .venv/bin/python bench/call_cost.py --baseline /tmp/base [--checkout /tmp/head] --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.schedule_cost import counter_deltas, package_tree  # noqa: E402
from bench.sweep import relative_paths  # noqa: E402
from specserve.shared.host.launch import ServiceProcess  # noqa: E402

PARTS = ("draft", "target", "transport", "schedule")


class Services:
    """A target and a draft of one version (PYTHONPATH), on TCP or Unix sockets, with extra flags."""

    def __init__(self, pythonpath: str | None, unix: bool, flags: tuple[str, ...] = ()):
        self.pythonpath = pythonpath
        with _pythonpath(pythonpath):
            self.target = ServiceProcess("target", *flags, threads=1, unix=unix)
            self.draft = ServiceProcess("draft", *flags, threads=1, unix=unix)

    def gateway(self, policy: str, profile: str, gateway_args: list[str]) -> ServiceProcess:
        with _pythonpath(self.pythonpath):
            return ServiceProcess("gateway", "--draft", self.draft.address, "--target", self.target.address,
                                  "--policy", policy, "--profile", profile, *gateway_args)

    def stop(self) -> None:
        self.draft.stop()
        self.target.stop()


class _pythonpath:  # noqa: N801 (a context manager named for what it sets)
    def __init__(self, value: str | None):
        self.value, self.old = value, os.environ.get("PYTHONPATH")

    def __enter__(self) -> None:
        if self.value:
            os.environ["PYTHONPATH"] = self.value

    def __exit__(self, *_: object) -> None:
        if self.old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = self.old


async def one_at_a_time(url: str, requests: int, tokens: int) -> dict[str, float]:
    """`requests` streamed requests one after another (after a warm-up); ms per iteration of each share."""
    d = await counter_deltas(url, tokens, requests, at_once=False)
    iters = d.get("specserve:iterations_total", 0.0)
    out = {f"{p}_ms": d.get(f"specserve:iteration_{p}_seconds_total", 0.0) / iters * 1e3 for p in PARTS}
    out["iteration_ms"] = sum(out[f"{p}_ms"] for p in PARTS)
    out["transport_schedule_ms"] = out["transport_ms"] + out["schedule_ms"]
    out["iterations"] = iters
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a checkout of the earlier version")
    ap.add_argument("--checkout", help="a checkout of the later version (default: this one), e.g. a frozen copy "
                    "of a commit, so that editing this one during the run changes nothing")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="none,chain:4")
    ap.add_argument("--requests", type=int, default=4, help="requests per point, one at a time")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile", default=str(ROOT / "bench/results/sweep-full/profile.json"))
    ap.add_argument("--gateway-args", default="")
    ap.add_argument("--out", default=str(ROOT / "bench/results/call_cost.json"))
    args = ap.parse_args()
    def revision(checkout: str) -> str:  # a git checkout's short commit, else the directory's name
        return subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or Path(checkout).name

    base_rev = revision(args.baseline)
    head_rev = revision(args.checkout or str(ROOT))
    versions: dict[str, str | None] = {
        f"before ({base_rev})": str(package_tree(Path(args.baseline).resolve())),
        f"after ({head_rev})": str(package_tree(Path(args.checkout).resolve())) if args.checkout else None}
    after = list(versions)[1]
    # (version, socket kind, the services' extra flags): every version on both kinds, and the later one
    # on Unix sockets with every model call on the model thread (no inline calls), which isolates that change
    points: list[tuple[str, str, tuple[str, ...]]] = [(v, kind, ()) for v in versions for kind in ("tcp", "unix")]
    points.append((after, "unix", ("--inline-tokens", "0")))
    policies = args.policies.split(",")
    rows: list[dict] = []
    for rnd in range(args.rounds):
        for version, kind, flags in (points if rnd % 2 == 0 else list(reversed(points))):
            services = Services(versions[version], unix=kind == "unix", flags=flags)
            try:
                for policy in policies:
                    gateway = services.gateway(policy, args.profile, args.gateway_args.split())
                    try:
                        t0 = time.perf_counter()
                        r = asyncio.run(one_at_a_time(gateway.address, args.requests, args.tokens))
                    finally:
                        gateway.stop()
                    rows.append({"round": rnd, "version": version, "socket": kind, "flags": " ".join(flags),
                                 "policy": policy, **r})
                    print(f"round {rnd} {version} {kind} {' '.join(flags)} {policy}: transport "
                          f"{r['transport_ms']:.3f} + schedule {r['schedule_ms']:.3f} ms/iteration of "
                          f"{r['iteration_ms']:.2f}, {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            finally:
                services.stop()
    summary = []
    for policy in policies:
        for version, kind, flags in points:
            got = [r for r in rows if (r["policy"], r["version"], r["socket"], r["flags"]) ==
                   (policy, version, kind, " ".join(flags))]

            def stat(key: str, got: list[dict] = got) -> dict[str, float]:
                values = [r[key] for r in got]
                return {"median": statistics.median(values), "min": min(values), "max": max(values)}

            summary.append({"policy": policy, "version": version, "socket": kind, "flags": " ".join(flags),
                            **{k: stat(k) for k in ("transport_schedule_ms", "transport_ms", "schedule_ms",
                                                    "iteration_ms", "draft_ms", "target_ms")}})
    run_args = relative_paths(vars(args) | {"baseline": f"a checkout of {base_rev}",  # no machine paths
                                            "checkout": f"a checkout of {head_rev}"})
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary, "args": run_args}, indent=1))
    print("| policy | version | services on | transport + schedule, ms / iteration, median (min-max) | transport | "
          "schedule | vs before, TCP | iteration ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for s in summary:
        ref = next(x for x in summary if x["policy"] == s["policy"] and x["socket"] == "tcp"
                   and x["version"] == next(iter(versions)))
        ts = s["transport_schedule_ms"]
        where = s["socket"] + (f", {s['flags']}" if s["flags"] else "")
        print(f"| {s['policy']} | {s['version']} | {where} | {ts['median']:.3f} ({ts['min']:.3f}-{ts['max']:.3f})"
              f" | {s['transport_ms']['median']:.3f} | {s['schedule_ms']['median']:.3f} | "
              f"{ts['median'] / ref['transport_schedule_ms']['median']:.2f}x | {s['iteration_ms']['median']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
