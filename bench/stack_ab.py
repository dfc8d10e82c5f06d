"""The stack's own time on the near-null target, two revisions side by side in one checkout.

    .venv/bin/python bench/stack_ab.py OLD NEW [--rounds 3] [--inflight 64,256] [--seconds 8] [--out FILE]

Each round runs both revisions, in an order that alternates by round: the files under services/ and shared/ that
differ between either revision and HEAD are checked out from the revision into this working tree, a child process
starts a stack on the near-null target (the demo draft served as the target, `none`) with `--async-scheduling
off` beside a second gateway with it on, and runs bench/step_overhead.py's closed loop at each level on both
(`off`, `on`); after the last round HEAD's files are put back (should it be killed, `git checkout HEAD --
services shared` does it: it refuses to start while those files have changes that are not committed). The
editable install serves this tree: nothing else may run from it meanwhile, and no file may be edited. Reported
per revision, level and flag: the medians (min-max over rounds) of the stack's own time per iteration (the wall
time over the gateway's iterations, less the target's pass), the target's own work around its pass (inside the
service, the frame's codec excluded), the pass, and tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.sweep import spread  # noqa: E402

METRICS = ("stack_ms", "target_service_ms", "target_ms", "tokens_per_s")
RESULT_LINE = "STACK_AB_RESULT "


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def swapped_files(revisions: list[str]) -> list[str]:
    """The files under services/ and shared/ that differ between any of `revisions` and HEAD."""
    return sorted({f for rev in revisions for f in _git("diff", "--name-only", rev, "HEAD", "--", "services",
                                                         "shared").split()})


def child(levels: list[int], seconds: float, profile: str) -> list[dict]:
    """One revision's measurement, in a process that imported this tree as it is now."""
    from bench.step_overhead import NEW_TOKENS, PROMPT, closed_loop
    from specserve.shared.runtime.model_store import MODELS
    from tests.support.procs import Up, gateway

    model = str(MODELS / "draft")
    up = Up("--model", model, "--draft-model", model, "--policy", "none", "--threads", "1", "--profile", profile,
            "--", "--async-scheduling", "off", timeout_s=600)
    ahead = gateway(up, "none", "--model", model, "--profile", profile, "--async-scheduling", "on")
    rows = []
    try:
        for n in levels:
            for flag, url in (("off", up.url), ("on", ahead.address)):
                rows.append({**asyncio.run(closed_loop(url, n, seconds, PROMPT, NEW_TOKENS)), "flag": flag})
    finally:
        ahead.stop()
        up.interrupt()
    return rows


def summary(rows: list[dict]) -> dict:
    """By revision, level and flag: each metric's median, min and max over the rounds."""
    cells: dict[str, list[dict]] = {}
    for r in rows:
        cells.setdefault(f"{r['rev']} @{r['inflight']} {r['flag']}", []).append(r)
    return {k: {m: spread([r[m] for r in v]) for m in METRICS} for k, v in sorted(cells.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inflight", default="64,256")
    ap.add_argument("--seconds", type=float, default=8.0, help="steady window per level")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stack_ab.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the profile path: measure this tree as it is
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.inflight.split(",")]
    if args.child:
        print(RESULT_LINE + json.dumps(child(levels, args.seconds, args.child)), flush=True)
        return 0
    os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))  # the child's services and gateways share it
    revisions = [_git("rev-parse", "--short", r).strip() for r in (args.old, args.new)]
    files = swapped_files(revisions)
    dirty = _git("status", "--porcelain", "--", *files) if files else ""
    if dirty:
        print(f"error: uncommitted changes in files this would swap:\n{dirty}", file=sys.stderr)
        return 2
    profile = str(Path(tempfile.mkdtemp()) / "profile.json")  # one profile for both: their passes are the same
    rows: list[dict] = []
    try:
        for r in range(args.rounds):
            for rev in revisions if r % 2 == 0 else revisions[::-1]:
                if files:
                    _git("checkout", rev, "--", *files)
                proc = subprocess.run([sys.executable, __file__, args.old, args.new, "--inflight", args.inflight,
                                       "--seconds", str(args.seconds), "--child", profile],
                                      capture_output=True, text=True)
                lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_LINE)]
                if proc.returncode or not lines:
                    print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                    return 1
                for x in json.loads(lines[0][len(RESULT_LINE):]):
                    rows.append({**x, "rev": rev, "round": r + 1})
                    print(f"round {r + 1} {rev} @{x['inflight']} {x['flag']}: stack {x['stack_ms']:.3f} ms, target's "
                          f"own {x['target_service_ms']:.3f} ms, pass {x['target_ms']:.3f} ms, "
                          f"{x['tokens_per_s']:.0f} tokens/s", flush=True)
    finally:
        if files:
            _git("checkout", "HEAD", "--", *files)
    result = {"old": revisions[0], "new": revisions[1], "rounds": args.rounds, "seconds": args.seconds,
              "files": files, "summary": summary(rows), "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for cell, m in result["summary"].items():
        print(cell + ": " + ", ".join(f"{k} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" for k, v in m.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
