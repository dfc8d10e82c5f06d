"""The README's flag tables and endpoint list against the code: every flag and endpoint it lists exists, and
every one that exists is listed. The `specserve up`, `gateway` and `bench` tables are compared with each
command's `--help`, both ways; every other `--flag` the README names must belong to some specserve command."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SPECSERVE = [sys.executable, "-m", "specserve.cli"]
FLAG = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")


def help_flags(command: str) -> tuple[set[str], str]:
    """The option strings of `specserve COMMAND --help`, read from its option lines, and the help text."""
    proc = subprocess.run([*SPECSERVE, command, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    flags: set[str] = set()
    for line in proc.stdout.splitlines():
        m = re.match(r"  (-\S.*?)(?:\s{2,}|$)", line)  # "  --host HOST   the gateway's ..." / "  -h, --help"
        if m:
            flags |= {f for f in FLAG.findall(m.group(1))}
    return flags, proc.stdout


def table_flags(header: str, text: str | None = None) -> set[str]:
    """The flags in the first column of the README table whose header row starts with `header`."""
    lines = (text if text is not None else README.read_text()).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    flags: set[str] = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        first = line.split("|")[1]
        for code in re.findall(r"`([^`]+)`", first):
            if code.strip() == "-- ...":
                flags.add("--")
            elif code.startswith("-"):
                flags.add(code.split()[0])
    return flags


@pytest.mark.parametrize("command", ["up", "gateway", "bench"])
def test_flag_table_matches_help(command):
    documented = table_flags(f"| flag of `specserve {command}`")
    flags, text = help_flags(command)
    if "gateway_args" in text:  # `up`'s positional: whatever follows -- goes to the gateway
        flags.add("--")
    assert documented - flags == set(), f"README lists flags `specserve {command}` does not have"
    assert flags - documented == set(), f"`specserve {command}` has flags the README's table does not list"


def test_the_check_sees_a_missing_flag():
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `--tcp-services`"))
    documented = table_flags("| flag of `specserve up`", text.replace(row + "\n", ""))
    flags, _ = help_flags("up")
    assert flags - documented - {"--"} == {"--tcp-services"}


def _parser_flags() -> set[str]:
    from specserve.cli.main import build_parser

    out: set[str] = set()
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= {o for a in sub._actions for o in a.option_strings}
    return out


def test_every_flag_named_in_the_readme_exists():
    sweep = subprocess.run([sys.executable, str(ROOT / "bench" / "sweep.py"), "--help"],
                           capture_output=True, text=True, timeout=120)
    known = _parser_flags() | set(FLAG.findall(sweep.stdout))
    known |= {"--fast",  # scripts/test.sh's fast tier
              "--scale", "--build-arg"}  # docker compose's and docker build's own
    named = {f for f in FLAG.findall(README.read_text()) if f.startswith("--") and f != "--"}
    unknown = {f for f in named if f not in known
               and not (f.endswith("-") and any(k.startswith(f) for k in known))}  # `--nightjar-*`
    assert not unknown, f"the README names flags no command has: {sorted(unknown)}"


def test_endpoints_match_the_gateway_routes():
    source = (ROOT / "services" / "gateway" / "http" / "server.py").read_text()
    routes = {(m.upper(), path) for m, path in re.findall(r'router\.add_(get|post)\("([^"]+)"', source)}
    line = next(p for p in README.read_text().split("\n\n") if p.startswith("Endpoints:"))
    documented = set(re.findall(r"`(GET|POST) (/[\w/]*)`", line))
    assert routes, "no routes found in the gateway's source"
    assert documented == routes
