"""The README and the user docs against the code and the tree.

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
