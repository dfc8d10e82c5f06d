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

Here: the tests that start no process and open no socket; the others are in tests/service/test_readme.py.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
from pathlib import Path

import pytest

from tests.support.markdown import broken_links, repo_paths

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
DEPLOYMENT = ROOT / "docs" / "deployment.md"
FLAGS_DOC = ROOT / "docs" / "flags.md"
DOCS = [README, USAGE, FLAGS_DOC, DEPLOYMENT]


def _parser() -> argparse.ArgumentParser:
    from specserve.cli.main import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _doc_rows(text: str) -> dict[str, set[str]]:
    """The first-column code spans of each `## \\`specserve NAME\\`` table in docs/flags.md."""
    out: dict[str, set[str]] = {}
    command = None
    for line in text.splitlines():
        if m := re.match(r"## `specserve (\w+)`", line):
            command = m.group(1)
            out[command] = set()
        elif command and line.startswith("| `"):
            out[command] |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return out


def test_flags_doc_is_what_the_parser_gives_now():
    from specserve.cli.flags import flags_markdown

    want, have = flags_markdown(), FLAGS_DOC.read_text()
    diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "docs/flags.md", "parser"))
    assert have == want, f"docs/flags.md is stale: run `python scripts/gen_flags.py`\n{diff[:4000]}"


def test_flags_doc_lists_every_flag_of_every_command():
    rows = _doc_rows(FLAGS_DOC.read_text())
    for name, sub in _subparsers(_parser()).items():
        flags = {o for a in sub._actions for o in a.option_strings} - {"-h", "--help"}
        assert flags <= rows.get(name, set()), f"docs/flags.md lacks `specserve {name}` {flags - rows[name]}"


def test_the_check_sees_a_new_flag():
    """A flag added to a command changes what the generator makes, so the file check above fails."""
    from specserve.cli.flags import flags_markdown

    parser = _parser()
    _subparsers(parser)["up"].add_argument("--not-documented", type=int, default=3, help="a flag added late")
    text = flags_markdown(parser)
    assert text != FLAGS_DOC.read_text()
    assert "| `--not-documented` | 3 |  | a flag added late |" in text.splitlines()


def _commands(doc: Path) -> list[list[str]]:
    """`specserve` command lines shown in `doc` (code blocks and inline code), as arguments after
    `specserve`; `bash scripts/run.sh ARGS` is `specserve up ARGS`. Lines with placeholders (`N`,
    `DIR`, `<address>`, `[...]`, `...`) or shell substitutions are left out."""
    text = doc.read_text()
    candidates = re.findall(r"```\w*\n(.*?)```", text, flags=re.S)
    lines = [line for block in candidates for line in block.splitlines()]
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    out = []
    for line in lines:
        line = line.split(" #")[0].strip().rstrip("&").strip()
        m = re.match(r"(?:(?:\.venv/bin/)?specserve|bash scripts/run\.sh)(?:\s+(.*))?$", line)
        if not m or re.search(r"[<>\[\]|$]|\.\.\.", line):
            continue
        args = shlex.split(m.group(1) or "")
        if any(re.fullmatch(r"[A-Z][A-Z_:]*", a) for a in args) or {"-h", "--help"} & set(args):
            continue
        out.append(["up", *args] if line.startswith("bash") else args)
    return out


@pytest.mark.parametrize("doc", [README, USAGE, DEPLOYMENT], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_commands_shown_parse(doc):
    commands = [c for c in _commands(doc) if c]
    assert commands, f"no specserve command found in {doc.name}"
    for args in commands:
        try:
            ns = _parser().parse_args(args)
            gateway_args = [a for a in getattr(ns, "gateway_args", []) if a != "--"]
            if gateway_args:  # `specserve up -- --admission fifo`: the gateway must take them too
                _parser().parse_args(["gateway", *gateway_args])
        except SystemExit:
            pytest.fail(f"{doc.name}: `specserve {shlex.join(args)}` does not parse")


def test_endpoints_match_the_gateway_routes():
    source = (ROOT / "services" / "gateway" / "http" / "server.py").read_text()
    routes = {(m.upper(), path) for m, path in re.findall(r'router\.add_(get|post)\("([^"]+)"', source)}
    line = next(p for p in USAGE.read_text().split("\n\n") if p.startswith("Endpoints:"))
    documented = set(re.findall(r"`(GET|POST) (/[\w/]*)`", line))
    assert routes, "no routes found in the gateway's source"
    assert documented == routes


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_exist(doc):
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"
    paths = repo_paths(doc)
    assert paths, f"no repository path found in {doc.name}"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_readme_is_short():
    assert len(README.read_bytes()) <= 12_000
