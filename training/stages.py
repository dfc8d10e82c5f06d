"""The stage loop shared by the build scripts: run the chosen stages in order, or every one not yet done;
and the scripts' common command line (`build_main`)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def run_stages(stages: Sequence[str], chosen: Sequence[str] | None, done: Callable[[str], bool],
               run: Callable[[str], None], state: dict, report: Path,
               after: Callable[[], None] | None = None) -> None:
    """Run `chosen` stages (redone even if done), or every stage whose `done` is false; after each one
    write `state` to `report` and call `after`."""
    for stage in stages:
        if chosen and stage not in chosen:
            continue
        if not chosen and done(stage):
            print(f"[build] {stage}: done, skipping", flush=True)
            continue
        print(f"[build] {stage}", flush=True)
        run(stage)
        report.write_text(json.dumps(state, indent=2) + "\n")
        if after is not None:
            after()


def build_main(argv: list[str] | None, doc: str, stages: dict[str, Callable[[dict, argparse.Namespace], None]],
               outputs: dict[str, Path], build: Path, out: Path) -> int:
    """A build script's command line (--stage, --threads, --limit): `stages` (name -> the stage, given the
    state and the arguments) run as `run_stages` runs them, a stage counting as done where its file in
    `outputs` exists; the state is kept in build/report.json, copied into `out` once that exists."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=list(stages), action="append", help="run only these stages (repeatable)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--limit", type=int, help="only this many training prompts (a quick trial)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    build.mkdir(parents=True, exist_ok=True)
    report = build / "report.json"
    state = json.loads(report.read_text()) if report.exists() else {}
    t0 = time.perf_counter()
    run_stages(list(stages), args.stage, lambda stage: stage in outputs and outputs[stage].exists(),
               lambda stage: stages[stage](state, args), state, report)
    print(f"[build] done in {time.perf_counter() - t0:.0f} s", flush=True)
    if out.is_dir():
        shutil.copy(report, out / "report.json")
    return 0
