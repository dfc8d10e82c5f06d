"""The README and the user docs against the code and the tree.

- docs/flags.md is generated from the `specserve` parser (scripts/gen_flags.py): it must equal what
  `flags_markdown()` makes now, so a flag added or changed without regenerating it fails here, and it
  has a row for every flag of every command.
- Every `specserve` command line that README.md, docs/usage.md and docs/deployment.md show parses, and
  every `--flag` they name belongs to some specserve command (or bench/sweep.py, or the tool it is
  given to).
- docs/usage.md's endpoint list is the gateway's routes.
- Every relative link in README.md, docs/usage.md, docs/flags.md and docs/deployment.md lands on a file
  and heading that exist, and every repository path they name exists.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_readme.py.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
DEPLOYMENT = ROOT / "docs" / "deployment.md"
FLAG = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")


def _parser() -> argparse.ArgumentParser:
    from specserve.cli.main import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _parser_flags() -> set[str]:
    return {o for sub in _subparsers(_parser()).values() for a in sub._actions for o in a.option_strings}


def test_every_flag_named_in_the_docs_exists():
    sweep = subprocess.run([sys.executable, str(ROOT / "bench" / "sweep.py"), "--help"],
                           capture_output=True, text=True, timeout=120)
    known = _parser_flags() | set(FLAG.findall(sweep.stdout))
    known |= {"--fast",  # scripts/test.sh's fast tier
              "--scale", "--build-arg", "--network",  # docker compose's, docker build's, docker run's own
              "--config", "--from-literal", "--replicas"}  # prometheus's and kubectl's own
    for doc in (README, USAGE, DEPLOYMENT):
        named = {f for f in FLAG.findall(doc.read_text()) if f.startswith("--") and f != "--"}
        unknown = {f for f in named if f not in known
                   and not (f.endswith("-") and any(k.startswith(f) for k in known))}  # `--nightjar-*`
        assert not unknown, f"{doc.name} names flags no command has: {sorted(unknown)}"
