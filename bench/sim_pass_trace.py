"""Where a simulated stack's time differs from the real one under load: every model pass of the
target and the draft, real and simulated, at one load point, against the latency model.

    .venv/bin/python bench/sim_pass_trace.py [--policy none] [--point c16] [--preset cpu-demo]

Both stacks (bench/sweep.py's Stack, the same profile and seed) run the point of
bench/sim_fidelity.py once. A probe (a `sitecustomize` put first on the services' PYTHONPATH for
these runs only; not part of the product) wraps `ModelRunner.forward` in every service and logs per
pass its composition (per entry: kind, new tokens, context), its wall time and the CPU time of the
calling thread (`time.thread_time`: with one torch thread the pass runs on that thread). Per pass
kind (decode only, prefill only, mixed) this reports the wall time, the CPU time and the preset's
modelled time of the same compositions:
- wall > CPU: the pass waited for a core (contention), which the sleeping simulation never does;
- CPU > model: the model misses a term for that composition;
and the gateway's own split of the iteration (bench summary: draft, target, transport, schedule).
Results: bench/results/sim_pass_trace.json (the real stack's figures are measured; the other
stack's are simulated, preset --preset).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_fidelity import points  # noqa: E402
from sim_scale import cpu_of  # noqa: E402
from sweep import ROOT, Stack, bench_point, measure_profile, warm_up  # noqa: E402

from specserve.shared.simulate.latency import LatencyModel  # noqa: E402
from specserve.shared.simulate.preset import load_preset  # noqa: E402

TRACE_VAR = "SPECSERVE_BENCH_PASS_TRACE"  # the directory the probe writes to (bench only)

# The probe: patches ModelRunner.forward once specserve.shared.runtime.runner is imported (an import hook,
# so processes that never import it, the CLI and the load generator, load nothing more).
PROBE = '''
import importlib.abc, importlib.util, json, os, sys, time

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "specserve.shared.runtime.runner":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module.ModelRunner)
        spec.loader.exec_module = exec_module
        return spec

def _patch(cls):
    forward = cls.forward
    out = open(os.path.join(os.environ["@VAR@"], f"pass-{os.getpid()}.jsonl"), "a", buffering=1)

    def traced(self, entries, *args, **kwargs):
        comp = [[type(e).__name__[0], len(e.tokens),
                 self.blocks.num_slots(e.request_id) if e.request_id in self.blocks else 0] for e in entries]
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return forward(self, entries, *args, **kwargs)
        finally:
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            kind = "target" if "target" in sys.argv else "draft" if "draft" in sys.argv else "?"
            out.write(json.dumps({"service": kind, "t": time.time(), "entries": comp,
                                  "wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3}) + "\\n")
    cls.forward = traced

if os.environ.get("@VAR@"):
    sys.meta_path.insert(0, _Hook())
'''.replace("@VAR@", TRACE_VAR)


def pass_kind(entries: list) -> str:
    prefill = any(e[0] == "C" for e in entries)
    decode = any(e[0] != "C" for e in entries)
    return "mixed" if prefill and decode else "prefill" if prefill else "decode"


def summarize(passes: list[dict], model: LatencyModel) -> dict:
    """Per pass kind: count, total wall / CPU / modelled ms, their ratios, and the median composition."""
    out = {}
    for kind in ("decode", "prefill", "mixed", "all"):
        sel = [p for p in passes if kind == "all" or pass_kind(p["entries"]) == kind]
        if not sel:
            continue
        wall = sum(p["wall_ms"] for p in sel)
        cpu = sum(p["cpu_ms"] for p in sel)
        mod = sum(model.pass_ms([(n, c) for _, n, c in p["entries"]]) for p in sel)
        out[kind] = {"passes": len(sel), "wall_ms": round(wall, 1), "cpu_ms": round(cpu, 1), "model_ms": round(mod, 1),
                     "wall_over_model": round(wall / mod, 3), "cpu_over_model": round(cpu / mod, 3),
                     "wall_over_cpu": round(wall / cpu, 3) if cpu else None,
                     "median_entries": statistics.median(len(p["entries"]) for p in sel),
                     "median_new_tokens": statistics.median(sum(e[1] for e in p["entries"]) for p in sel),
                     "median_context": statistics.median(sum(e[2] for e in p["entries"]) for p in sel)}
    return out


def run(policy: str, profile: Path, simulate: str | None, fields: dict, point: str, seed: int, tmp: Path) -> dict:
    trace = Path(tempfile.mkdtemp(prefix="trace-", dir=tmp))
    os.environ[TRACE_VAR] = str(trace)
    try:
        with Stack(policy, profile, 1, [], simulate) as stack:
            warm_up(stack.url, tmp / "warm.jsonl")
            cpu0, t0, start = cpu_of(stack), time.perf_counter(), time.time()
            summary = bench_point(stack.url, tmp / f"{point}.jsonl", f"{policy} {point}", seed=seed, **fields)
            wall, cpu1 = time.perf_counter() - t0, cpu_of(stack)
    finally:
        os.environ.pop(TRACE_VAR, None)
    passes = [json.loads(line) for f in sorted(trace.glob("pass-*.jsonl")) for line in f.read_text().splitlines()]
    passes = [p for p in passes if p["t"] >= start]
    it = summary["iteration"]
    return {"tpot_p50_ms": summary["tpot_p50_ms"], "tokens_per_step": summary["tokens_per_step"],
            "attainment": summary["attainment"], "wall_s": round(wall, 2),
            "cpu_s": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0 if cpu0[k] is not None and cpu1[k] is not None},
            "iterations": it["iterations"], "iteration_ms": it["mean_ms"],
            "per_iteration_ms": {k: round(v / it["iterations"] * 1e3, 2) for k, v in it["seconds"].items()},
            "passes": passes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--policy", default="none")
    ap.add_argument("--point", default="c16", help="a point of bench/sim_fidelity.py: c1, c16, rate<R>")
    ap.add_argument("--duration-s", type=float, default=15.0, help="for a rate point, as in sim_fidelity.py")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stacks", default="real,simulated")
    ap.add_argument("--profile", default=None, help="the real target's profile (default: measure one)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sim_pass_trace.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sim-pass-trace-"))
    (tmp / "probe").mkdir()
    (tmp / "probe" / "sitecustomize.py").write_text(PROBE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp / "probe"), os.environ.get("PYTHONPATH")]))
    profile = Path(args.profile) if args.profile else tmp / "profile.json"
    if not args.profile:
        measure_profile(profile, 1, quick=True)
    rates = [float(args.point[4:])] if args.point.startswith("rate") else []
    fields = dict(points(rates, args.duration_s))[args.point]
    preset = load_preset(args.preset)
    models = {"target": preset.target, "draft": preset.draft}
    results: dict = {"preset": args.preset, "policy": args.policy, "point": args.point, "fields": fields,
                     "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": os.getloadavg(),
                     "stacks": {}}
    for kind in args.stacks.split(","):
        r = run(args.policy, profile, args.preset if kind == "simulated" else None, fields, args.point, args.seed, tmp)
        r["summary"] = {svc: summarize([p for p in r["passes"] if p["service"] == svc], models[svc])
                        for svc in ("target", "draft")}
        results["stacks"][kind] = r
        print(kind, json.dumps({k: v for k, v in r.items() if k != "passes"}, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
