"""The repository's Markdown as the doc tests read it: GitHub's heading anchors, the links of a file,
the links that land nowhere, and the repository paths a file names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> set[str]:
    """The anchors of `path`'s headings (not those inside code blocks)."""
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            out.add(slug(m.group(1)))
    return out


def links(path: Path) -> list[tuple[str, str]]:
    """(text, target) of every Markdown link in `path`, code blocks left out."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return LINK.findall(text)


def broken_links(doc: Path) -> list[str]:
    """The relative links of `doc` whose file, or whose heading in a .md file, does not exist."""
    broken = []
    for _, target in links(doc):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in headings(dest):
            broken.append(target)
    return broken


def repo_paths(doc: Path) -> set[str]:
    """The paths under one of the repository's top-level folders that `doc` names, in prose or code
    (`docs/usage.md`, `services/cli/`, `bench/results/first_start.log`); wildcards and placeholders end
    a path there (`bench/workloads/*.jsonl` names `bench/workloads/`)."""
    tops = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (not p.name.startswith(".") or p.name == ".ci"))
    alternatives = "|".join(map(re.escape, tops))
    pattern = re.compile(rf"(?<![\w/.~$<-])((?:{alternatives})/[\w./-]*)")
    return {m.rstrip(".,") for m in pattern.findall(doc.read_text())}
