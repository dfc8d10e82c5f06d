"""What tracing adds to an iteration while it is off, measured in process (no services, no noise from
other processes' scheduling): each thing the off path runs, timed alone over many repetitions.

Per iteration the gateway runs, with tracing off: one `tracing.ENABLED` test in the step loop, one
no-op `tracing.span("policy.select")`, and per service call one test in `Executor._guard` and one in
`RpcClient._round_trip` (the service: one in `RpcServer._call`); per request, one test at submit. Each
frame's header is encoded by a Header that also has an optional `trace` field (omitted when None),
so the header encode of a 64-request Forward is timed before (the old Header) and after.

    .venv/bin/python bench/tracing_off_cost.py [--out bench/results/tracing_off_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specserve.shared.process import tracing  # noqa: E402
from specserve.shared.wire.messages import Forward, Message, VerifyEntry  # noqa: E402
from specserve.shared.wire.transport import Header, TensorMeta  # noqa: E402


class OldHeader(msgspec.Struct):
    """transport.Header before the trace field."""

    call_id: int
    body: Message
    tensors: list[TensorMeta] = []


def per_call_ns(stmt, number: int, repeat: int) -> list[float]:
    return [t / number * 1e9 for t in timeit.repeat(stmt, number=number, repeat=repeat)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench/results/tracing_off_cost.json"))
    args = ap.parse_args()
    assert not tracing.ENABLED, "run without OTEL_EXPORTER_OTLP_*ENDPOINT"

    def check() -> None:
        if tracing.ENABLED:
            raise AssertionError

    def noop_span() -> None:
        with tracing.span("policy.select"):
            pass

    forward = Forward(verify=[VerifyEntry(f"cmpl-{i:032x}", 7, 300 + i, 5) for i in range(64)])
    metas = [TensorMeta("tree_tokens", "int32", [320], 1280), TensorMeta("tree_parents", "int32", [320], 1280)]
    enc = msgspec.msgpack.Encoder()
    old, new = OldHeader(1, forward, metas), Header(1, forward, metas)
    assert len(enc.encode(new)) == len(enc.encode(old)), "off, the header must be the same size"
    cases = {
        "ENABLED test": (check, 1_000_000),
        "no-op span (enter + exit)": (noop_span, 1_000_000),
        "carrier() while off": (tracing.carrier, 1_000_000),
        "Forward header (64 requests), old Header": (lambda: enc.encode(old), 20_000),
        "Forward header (64 requests), Header with trace field": (lambda: enc.encode(new), 20_000),
    }
    results = {}
    for name, (fn, number) in cases.items():
        ns = per_call_ns(fn, number, args.repeat)
        results[name] = {"median_ns": statistics.median(ns), "min_ns": min(ns), "max_ns": max(ns)}
        print(f"| {name} | {statistics.median(ns):.0f} ({min(ns):.0f}-{max(ns):.0f}) |")
    # one replica, draft and target calls: step-loop test + span + 2 calls x 2 tests (+1 header each)
    r = {k: v["median_ns"] for k, v in results.items()}
    per_iteration = r["ENABLED test"] * 5 + r["no-op span (enter + exit)"]
    print(f"off path per iteration (1 replica, 2 calls): {per_iteration:.0f} ns")
    Path(args.out).write_text(json.dumps({"cases": results, "off_path_per_iteration_ns": per_iteration,
                                          "repeat": args.repeat}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
