"""The flag reference, docs/flags.md, made from the `specserve` parser itself.

`flags_markdown()` walks `build_parser()`'s subcommands in order and writes one Markdown table per
subcommand: each argument's flag (or positional name), its default, its environment variable and its
help. Arguments declared through `specserve.shared.process.settings` give their default and variable
as `--help` shows them (`flag_doc`); the few plain argparse ones (smoke, kernels, models, profile) give
argparse's default and no variable. scripts/gen_flags.py writes the file, and tests/unit/test_readme.py
checks that the file equals what this returns now.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

from specserve.shared.process.settings import flag_doc

HEADER = """# Flags of every `specserve` command

Generated from the commands' parser by `python scripts/gen_flags.py`; do not edit it by hand
(tests/unit/test_readme.py fails when it differs from what the parser gives now). `specserve COMMAND --help`
shows the same flags, defaults and variables.

A flag with an environment variable reads it when the flag is not given; the command line wins. A
list variable is comma-separated (`SPECSERVE_GATEWAY_TARGET=a:8102,b:8102`); a switch's variable
takes `1`/`0`, `true`/`false` or `yes`/`no`. A bad value is reported with the variable's name, and
exit status 2. Every command also takes `-h`, `--help`.
"""


@contextmanager
def _without_specserve_env() -> Iterator[None]:
    """Hide SPECSERVE_* variables while the parser is built: a few plain argparse defaults read them."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("SPECSERVE_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _cell(text: str) -> str:
    """Text safe inside one Markdown table cell: no pipes, no line breaks."""
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _show(action: argparse.Action) -> str:
    """A plain argparse default as a cell: a flag's None is unset, a positional's empty; booleans on/off; text
    with line breaks quoted."""
    value = action.default
    if value is None:
        return "unset" if action.option_strings else ""
    if value == [] or value is argparse.SUPPRESS:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and "\n" in value:
        return f"`{value!r}`"
    return str(value)


def _row(action: argparse.Action) -> str:
    if action.nargs == argparse.REMAINDER:
        names = "`-- ...`"
    elif action.option_strings:
        names = ", ".join(f"`{name}`" for name in action.option_strings)
    else:
        names = f"`{action.dest}` (positional)"
    doc = flag_doc(action)
    if doc is not None:
        help_text, default, env = doc.help, doc.default or "", f"`{doc.env_var}`" if doc.env_var else ""
    else:
        help_text, default, env = action.help or "", _show(action), ""
    if action.choices is not None:
        choices = ", ".join(f"`{c}`" for c in action.choices)
        help_text = f"{help_text} (one of {choices})" if help_text else f"one of {choices}"
    return f"| {names} | {_cell(default)} | {env} | {_cell(help_text)} |"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order they were added."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            out += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return out


def flags_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """docs/flags.md's text for `parser` (by default `specserve`'s, built without SPECSERVE_* variables)."""
    if parser is None:
        from specserve.cli.main import build_parser

        with _without_specserve_env():
            parser = build_parser()
    commands = _subcommands(parser)
    parts = [HEADER, "Commands: " + ", ".join(f"[`{name}`](#specserve-{name})" for name, _, _ in commands) + ".\n"]
    for name, summary, sub in commands:
        rows = [_row(a) for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        parts.append(f"## `specserve {name}`\n\n{summary[:1].upper() + summary[1:]}.\n")
        if rows:
            parts.append("| flag | default | environment variable | what |\n|---|---|---|---|\n"
                         + "\n".join(rows) + "\n")
    return "\n".join(parts)
