"""A soak of hours under faults: the default stack under an SLO mix for N minutes, with nothing lost and
nothing growing.

    .venv/bin/python bench/soak.py --minutes 60                 # SmolLM2, 2 target replicas, 2 front ends
    .venv/bin/python bench/soak.py --minutes 5 --model demo --relax-tpot   # a short run on the demo pair

The stack is `specserve up --model M --targets 2 -- --frontends 2` (M: `smollm2-135m-instruct`, what
`up` serves by default and bench/smollm2_c1.py names; `demo` for a fast small run). The load is
AdaServe's SLO mix as bench/admission.py sends it (critical 60 % short prompts, search 20 % long,
flex 20 % short, which SLO admission may serve best effort; services/cli/loadgen/), streamed,
greedy, EOS ignored, at Poisson arrivals of `--load` (0.7) x the capacity measured first
(`--capacity-s` of `--capacity-concurrency` clients in a closed loop: the requests completed per
second), or at `--rate`. The first sixth of the run is the warm-up, which also takes one burst of
`--burst` requests (the stack's peak, so that allocators reach their high-water marks before RSS is
judged). Between the first and the last sixth, six faults are spread evenly (bench/soak_faults.py),
in this order: a burst of `--burst` (150) requests; a client that stops reading its stream; a client
that disconnects mid-stream; SIGKILL of the draft, of one target replica, of one front end (`up` and
the engine process start them again). After the warm-up, after every fault and at the end the load
pauses, in-flight requests end, and the soak polls until the stack is idle (an idle checkpoint),
then the load resumes.

Every `--sample-s` (30) it records, for every process of up's group (bench/soak_probe.py): RSS, open
descriptors, threads, event-loop tasks (the gateway's engine and front ends, each model service); the
KV blocks and requests each model service holds and what the gateway runs; and the TTFT and TPOT
p50 / p99 of the window from the client's records. The rules (bench/soak_rules.py): no request lost
that a fault did not own (refusals with 503 and Retry-After are counted apart); after the warm-up,
the RSS of every process grows by at most 2 MB per 10 minutes (its anonymous part: the file-backed
pages of mapped weights and libraries come and go with the page cache); at every idle checkpoint descriptors,
threads, tasks and KV blocks are back to their idle values within `--grace-s`; the TPOT p99 of the
last sixth of clean load (`--tpot-span-s`) within 10 % of the first sixth's (`--relax-tpot` reports
it without failing, for short runs on a shared machine: the output says so). Each fault must also
have done its part (the stack whole again, the slow client cut, the disconnected stream aborted),
and every gauge the rules read must have been read (a missing one would make a rule vacuous).

Writes bench/results/soak-<model>-<N>min.json (every sample, window, fault, checkpoint and rule)
and a .png beside it (bench/soak_plot.py); exits 0 only when every rule holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import soak_faults as faults  # noqa: E402
import soak_rules as rules  # noqa: E402
from soak_load import Load, Sent  # noqa: E402
from soak_probe import Probe  # noqa: E402
from sweep import machine_info, relative_paths  # noqa: E402

from specserve.cli.loadgen.workload import parse_mix  # noqa: E402

# The burst and the long stream first: every process reaches its allocators' high-water marks early,
# and a process restarted by a later kill is judged on the steady load after its own warm-up.
FAULTS = ("burst", "slow-client", "disconnect", "kill-draft", "kill-target", "kill-frontend")
RESULTS = ROOT / "bench" / "results"
RSS_MB_PER_10MIN = 2.0  # the RSS rule: growth after the warm-up, MB per 10 minutes
MIX = "critical=0.6:short,search=0.2:long,flex=0.2:short"  # AdaServe's, chat as flex (bench/admission.py's)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="minutes of steady load (after the capacity probe)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="up's --model (`demo`: the small demo pair)")
    ap.add_argument("--targets", type=int, default=2)
    ap.add_argument("--frontends", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each model service")
    ap.add_argument("--rate", type=float, help="requests/s (default: --load x the measured capacity)")
    ap.add_argument("--load", type=float, default=0.7, help="share of the measured capacity to run at")
    ap.add_argument("--capacity-s", type=float, default=60.0)
    ap.add_argument("--capacity-concurrency", type=int, default=16)
    ap.add_argument("--mix", default=MIX, help="the SLO mix, as `specserve bench --mix`")
    ap.add_argument("--burst", type=int, default=150, help="requests of the burst fault")
    ap.add_argument("--slow-client-tokens", type=int, help="max_tokens of the client that stops reading (default: "
                    "the context length less 200: enough output to fill the gateway's buffers)")
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--grace-s", type=float, default=120.0, help="how long a checkpoint or a recovery may take")
    ap.add_argument("--rss-mb-per-10min", type=float, default=RSS_MB_PER_10MIN,
                    help="the RSS rule's limit; another value is named in the output as a relaxed rule (a run of a "
                    "few minutes turns an allocator's one-off step of a few MB into a steep per-10-minute slope)")
    ap.add_argument("--tpot-tolerance", type=float, default=0.10)
    ap.add_argument("--tpot-span-s", type=float, help="seconds of clean load at the start and at the end whose TPOT "
                    "p99 the rule compares (default: a sixth of the run)")
    ap.add_argument("--relax-tpot", action="store_true", help="report the TPOT rule without failing on it")
    ap.add_argument("--profile", help="up's --profile (default: measured at start into a temporary file)")
    ap.add_argument("--gateway-args", default="", help="more gateway flags, e.g. '--stream-stall-s 5'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="result JSON (default bench/results/soak-<model>-<minutes>min.json)")
    args = ap.parse_args(argv)
    args.out = Path(args.out or RESULTS / f"soak-{args.model}-{args.minutes:g}min.json")
    return args


REQUEST_FIELDS = ("source", "sent_s", "end_s", "status", "ok", "ttft_ms", "tpot_ms", "frontend", "error", "category")


def request_row(s: Sent) -> list:
    r = s.record
    return [s.source, round(r.sent_s, 3), None if s.done_s is None else round(s.done_s, 3), r.status, r.ok,
            r.ttft_ms, r.tpot_ms, s.frontend, r.error, r.category]


def plan(duration_s: float, names: tuple[str, ...] = FAULTS) -> tuple[float, list[tuple[float, str]]]:
    """(warm-up end, [(start, fault)]): the faults spread evenly between the first and the last sixth."""
    warmup = duration_s / 6
    span = duration_s - 2 * warmup
    return warmup, [(warmup + span * (i + 0.5) / len(names), name) for i, name in enumerate(names)]


class Run:
    """One soak against a started `up` (tests/support/procs.py's Up)."""

    def __init__(self, args: argparse.Namespace, up: Any):
        self.args, self.up = args, up
        self.t0 = time.perf_counter()
        self.grace_s = args.grace_s
        self.probe = Probe(up.proc.pid, up.addresses, up.metrics, up.url)
        self.samples: list[dict] = []
        self.checkpoints: list[dict] = []
        self.faults: list[dict] = []
        self.disturbed: list[tuple[float, float]] = []
        self.baseline: dict[str, Any] = {}
        self.seen: dict[str, int] = {}
        self.phase = "start"
        self.end_s = float("inf")

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def go(self) -> dict:
        session_info = await self._server_info()
        self.max_model_len = session_info["max_model_len"]
        self.roles = set(self.probe.processes())
        self.load = Load(self.up.url, session_info["model"], parse_mix(self.args.mix), session_info["classes"],
                         1.0, self.t0, self.args.seed)
        sampler = asyncio.create_task(self._sampler())
        try:
            rate = self.args.rate or self.args.load * await self._capacity()
            self.load.rate = rate
            await self.load.drain()
            self.load_start = self.now()
            duration = self.args.minutes * 60
            warmup, steps = plan(duration)
            driver = asyncio.create_task(self.load.run(lambda: self.end_s))  # (end_s: not before the faults)
            self.phase = "warmup"
            self.load.resume()
            await asyncio.gather(*self.load.burst(self.args.burst, "warmup-burst"))  # the peak, in the warm-up
            await self._at(self.load_start + warmup)
            await self._checkpoint("baseline")
            for at, name in steps:
                await self._at(self.load_start + at)
                await self._fault(name)
            self.end_s = max(self.load_start + duration, self.now() + warmup)  # a steady tail after the faults
            self.phase = "load"
            await driver
            await self._checkpoint("end", resume=False)
        finally:
            sampler.cancel()
            await self.load.close()
            await self.probe.close()
        return self._result(session_info, rate, warmup)

    async def _server_info(self) -> dict:
        async with self.probe.session.get(f"{self.up.url}/v1/slo_classes") as r:
            classes = (await r.json())["classes"]
        async with self.probe.session.get(f"{self.up.url}/v1/models") as r:
            model = (await r.json())["data"][0]
        return {"classes": classes, "model": model["id"], "max_model_len": model["max_model_len"]}

    async def _at(self, t: float) -> None:
        if t > self.now():
            await asyncio.sleep(t - self.now())

    async def _capacity(self) -> float:
        """Requests completed per second by a closed loop of `--capacity-concurrency` clients."""
        self.phase = "capacity"
        start, end = self.now(), self.now() + self.args.capacity_s

        async def client() -> None:
            while self.now() < end:
                sent = await self.load.start(self.load.next_request(), "capacity")
                if not sent.record.ok:  # refused (503): back off as a client would, not spin
                    await asyncio.sleep(min(sent.record.retry_after_s or 1.0, 1.0))

        await asyncio.gather(*(client() for _ in range(self.args.capacity_concurrency)))
        done = [s for s in self.load.sent if s.source == "capacity" and s.record.ok]
        self.capacity = len(done) / (self.now() - start)
        print(f"capacity: {self.capacity:.2f} req/s completed ({len(done)} in {self.now() - start:.0f} s)",
              file=sys.stderr, flush=True)
        return self.capacity

    async def _sampler(self) -> None:
        next_t = self.now()
        while True:
            snap = await self.probe.snapshot(self.now())
            snap["health"] = await self.probe.health()
            snap["phase"] = self.phase
            self.samples.append(snap)
            next_t += self.args.sample_s
            await self._at(next_t)

    async def _fault(self, name: str) -> None:
        start = self.now()
        self.phase = f"fault:{name}"
        print(f"[{start:7.1f} s] fault {name}", file=sys.stderr, flush=True)
        run = {"kill-draft": faults.kill_draft, "kill-target": faults.kill_target,
               "kill-frontend": faults.kill_frontend, "burst": lambda s: faults.burst(s, self.args.burst),
               "slow-client": lambda s: faults.slow_client(s, self.args.slow_client_tokens or self.max_model_len - 200),
               "disconnect": faults.disconnect}[name]
        record = await run(self)
        self.faults.append(record)
        print(f"           {json.dumps(record)}", file=sys.stderr, flush=True)
        await self._checkpoint(name)
        self.disturbed.append((start, self.now()))

    async def _checkpoint(self, name: str, resume: bool = True) -> None:
        """Pause the load, let it end, poll until idle (rules.idle_differences), record, resume."""
        start = self.now()
        self.phase = f"checkpoint:{name}"
        self.load.pause()
        await self.load.drain()
        drained = self.now()

        baseline = dict(self.baseline)
        trail: list[tuple[float, list[str]]] = []  # (t, differences) each time they change

        async def snapshot() -> dict:
            snap = await self.probe.snapshot(self.now())
            snap["health"] = await self.probe.health()
            diffs = rules.idle_differences(baseline, snap)
            if not trail or trail[-1][1] != diffs:
                trail.append((round(self.now() - drained, 2), diffs))
            return snap

        idle, snap = await faults.until(snapshot, lambda s: not rules.idle_differences(baseline, s), self.grace_s)
        given = rules.update_baseline(self.baseline, self.seen, snap)
        self.checkpoints.append({"name": name, "start_s": start, "drained_s": drained, "end_s": self.now(),
                                 "idle": idle, "differences": rules.idle_differences(baseline, snap), "trail": trail,
                                 "baseline_set": given, "snapshot": snap})
        print(f"[{self.now():7.1f} s] checkpoint {name}: {'idle' if idle else 'NOT idle'} after "
              f"{self.now() - drained:.1f} s" + ("" if idle else f": {rules.idle_differences(baseline, snap)}"),
              file=sys.stderr, flush=True)
        if name == "baseline":
            self.disturbed.append((start, self.now()))
        self.phase = "load"
        if resume:
            self.load.resume()

    def _result(self, info: dict, rate: float, warmup: float) -> dict:
        done = [(s.end_s, s.record) for s in self.load.sent if s.source == "load"]
        wins = rules.windows(self.samples, done, self.disturbed, self.load_start + warmup)
        return {"title": f"soak: {self.args.model}, {self.args.targets} target replicas, {self.args.frontends} front "
                         f"ends, {rate:.2f} req/s, {self.args.minutes:g} min",
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()},
                "model": info["model"], "classes": info["classes"], "capacity_rps": getattr(self, "capacity", None),
                "rate_rps": rate, "load_start_s": self.load_start, "warmup_end_s": self.load_start + warmup,
                "end_s": self.now(), "faults": self.faults, "checkpoints": self.checkpoints, "windows": wins,
                "samples": self.samples, "accounting": rules.account(self.load.sent, self.faults),
                "requests_fields": REQUEST_FIELDS, "requests": [request_row(s) for s in self.load.sent]}


async def _soak(args: argparse.Namespace, up: Any) -> dict:
    return await Run(args, up).go()  # (made inside the event loop: its aiohttp sessions need one)


def evaluate(result: dict, args: argparse.Namespace) -> dict[str, dict]:
    """Every rule's verdict (ok) and what it found."""
    acc = result["accounting"]
    steady = [s for s in result["samples"] if s["t"] >= result["load_start_s"]]
    warmup = result["warmup_end_s"] - result["load_start_s"]
    growth = rules.rss_growth(steady, result["warmup_end_s"], warmup)
    total = {(g["role"], g["pid"]): g for g in rules.rss_growth(steady, result["warmup_end_s"], warmup, field="rss_mb")}
    for g in growth:  # the whole RSS beside it, reported only
        t = total[(g["role"], g["pid"])]
        g |= {"rss_first_mb": t["first_mb"], "rss_last_mb": t["last_mb"], "rss_mb_per_10min": t["mb_per_10min"]}
    over = [g for g in growth if g["mb_per_10min"] is not None and g["mb_per_10min"] > args.rss_mb_per_10min]
    bad_faults = [f["name"] for f in result["faults"] if f.get("recovery_s") is None or f.get("cut") is False
                  or f.get("aborted") is False]
    not_idle = [c["name"] for c in result["checkpoints"] if not c["idle"]]
    load = [(r[2], r[6]) for r in result["requests"] if r[0] == "load" and r[4] and r[6] is not None]
    base = next((c["snapshot"] for c in result["checkpoints"] if c["name"] == "baseline"), None)
    unread = ["no baseline checkpoint"] if base is None else (
        [f"{r} tasks" for r, p in base["procs"].items() if r != "up" and p.get("tasks") is None]
        + [f"{n} KV" for n in base["procs"] if n.startswith(("draft", "target")) and n not in base["kv"]])
    tpot = rules.tpot_rule(result["windows"], load, args.tpot_tolerance, args.tpot_span_s or args.minutes * 10)
    out = {"lost": {"ok": not acc["lost"], "lost": len(acc["lost"]), "refused": acc["refused"],
                    "owned": acc["owned"], "completed": acc["completed"], "requests": acc["requests"]},
           "rss": {"ok": not over, "limit_mb_per_10min": args.rss_mb_per_10min, "over": over, "growth": growth,
                   "relaxed": args.rss_mb_per_10min != RSS_MB_PER_10MIN},
           "idle": {"ok": not not_idle, "not_idle": not_idle},
           "observed": {"ok": not unread, "unread": unread},
           "faults": {"ok": not bad_faults and len(result["faults"]) == len(FAULTS), "failed": bad_faults},
           "tpot": tpot | {"relaxed": args.relax_tpot}}
    if args.relax_tpot:
        out["tpot"]["ok_as_relaxed"] = True
    return out


def passed(verdicts: dict[str, dict]) -> bool:
    return all(v["ok"] or v.get("ok_as_relaxed") for v in verdicts.values())


def report(result: dict, verdicts: dict[str, dict]) -> str:
    acc, tpot, rss = verdicts["lost"], verdicts["tpot"], verdicts["rss"]
    lines = [result["title"],
             f"requests {acc['requests']}: completed {acc['completed']}, refused (503 + Retry-After) {acc['refused']}, "
             f"owned by faults {acc['owned']}, lost {acc['lost']}"]
    lines.append(f"  anonymous RSS limit {rss['limit_mb_per_10min']:g} MB / 10 min after the warm-up"
                 + (f" [relaxed from {RSS_MB_PER_10MIN:g}: --rss-mb-per-10min]" if rss["relaxed"] else ""))
    for g in rss["growth"]:
        if g["mb_per_10min"] is not None:
            lines.append(f"  rss {g['role']:<11} pid {g['pid']:<7} anon {g['first_mb']:7.1f} -> {g['last_mb']:7.1f}"
                         f" MB, {g['mb_per_10min']:+.2f} MB / 10 min over {g['points']} samples (whole RSS "
                         f"{g['rss_first_mb']:.1f} -> {g['rss_last_mb']:.1f} MB, {g['rss_mb_per_10min']:+.2f})")
        else:
            lines.append(f"  rss {g['role']:<11} pid {g['pid']:<7} not judged: {g['points']} samples after its "
                         "warm-up, less than a warm-up's length of them")
    for c in result["checkpoints"]:
        state = "idle" if c["idle"] else "NOT idle: " + "; ".join(c["differences"])
        lines.append(f"  checkpoint {c['name']:<13} {state} ({c['end_s'] - c['drained_s']:.1f} s after the load ended)")
    if "ratio" in tpot:
        lines.append(f"  TPOT p99 of the first {tpot['span_s']:.0f} s of clean load "
                     f"{tpot['first']['tpot_p99_ms']:.1f} ms ({tpot['first']['requests']} requests), of the last "
                     f"{tpot['last']['tpot_p99_ms']:.1f} ms "
                     f"({tpot['last']['requests']}): x{tpot['ratio']:.2f}, tolerance {tpot['tolerance']:.0%}"
                     + ("  [relaxed: --relax-tpot, reported only]" if tpot["relaxed"] else ""))
    else:
        lines.append(f"  TPOT: {tpot['why']}" + ("  [relaxed: --relax-tpot]" if tpot["relaxed"] else ""))
    for name, v in verdicts.items():
        state = ("relaxed (reported only)" if v.get("ok_as_relaxed") and not v["ok"] else
                 "ok (relaxed)" if v["ok"] and v.get("relaxed") else "ok" if v["ok"] else "BROKEN")
        lines.append(f"rule {name}: {state}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))
    from tests.support.procs import Up

    profile = args.profile or str(Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-profile-{os.getpid()}.json")
    up = Up("--model", args.model, "--targets", str(args.targets), "--threads", str(args.threads), "--profile",
            profile, "--", "--frontends", str(args.frontends), *args.gateway_args.split(), demo=False, timeout_s=900)
    try:
        result = asyncio.run(_soak(args, up))
    finally:
        up.interrupt()
    verdicts = evaluate(result, args)
    result["rules"] = verdicts
    result["passed"] = passed(verdicts)
    result["meta"] = machine_info() | {"argv": sys.argv[1:] if argv is None else argv}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(relative_paths(result), indent=1, default=str) + "\n")
    from soak_plot import plot

    plot(result, args.out.with_suffix(".png"))
    print(report(result, verdicts))
    print(f"results: {args.out} and {args.out.with_suffix('.png')}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
