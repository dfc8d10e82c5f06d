"""The stage loop shared by the build scripts: run the chosen stages in order, or every one not yet done."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path


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
