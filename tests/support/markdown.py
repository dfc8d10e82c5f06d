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


PLACEHOLDER = "<{*…["  # a path cut short by one of these names a family: `sweep-<name>/`, `run-{a,b}.json`


def missing_repo_paths(doc: Path) -> list[str]:
    """The repository paths `doc` names that do not exist. A path that stops at a placeholder or a
    wildcard (`bench/results/sweep-<name>/`, `history/kv-lad-tried-*.json`) is a prefix: it exists when
    some entry of its folder begins with it."""
    text = doc.read_text()
    tops = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (not p.name.startswith(".") or p.name == ".ci"))
    pattern = re.compile(rf"(?<![\w/.~$<-])((?:{'|'.join(map(re.escape, tops))})/[\w./-]*)")
    missing = set()
    for m in pattern.finditer(text):
        path = m.group(1).rstrip(".,")
        if (ROOT / path).exists():
            continue
        after = text[m.end():m.end() + 1]
        if after and after in PLACEHOLDER:
            folder, _, stem = path.rpartition("/")
            if (ROOT / folder).is_dir() and any(p.name.startswith(stem) for p in (ROOT / folder).iterdir()):
                continue
        missing.add(path)
    return sorted(missing)


# What a doc must not carry: the tracker's issue numbers and commit ids are history, not documentation.
# A commit id is a word of 7 to 12 hex digits with at least one letter and one digit; repository paths
# are taken out first, because result files are named after the commit that made them
# (`bench/results/cost_error-a2ede53.json`).
HISTORY_REF = re.compile(
    r"(?i:\bissues? \d+|\bissues?-\d+\b|\(stop \d+\))"  # `issue 48`, a heading's anchor `...-issue-48-...`
    r"|(?<![\w&#/])#\d+(?![\w-])"  # `#48` (not `&#39;`, not a link's `(#1-...` anchor)
    r"|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}\b")
HISTORY_ALLOWED: set[str] = set()  # exceptions, word for word, where a match is not an issue or a commit


def history_refs(doc: Path) -> list[str]:
    """`line: match` for every issue number or commit id in `doc` (outside repository paths)."""
    tops = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (not p.name.startswith(".") or p.name == ".ci"))
    path = re.compile(rf"(?<![\w/.~$<-])(?:{'|'.join(map(re.escape, tops))})/[\w./*{{}},<>…-]*")
    out = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for m in HISTORY_REF.finditer(path.sub("PATH", line)):
            if m.group(0) not in HISTORY_ALLOWED:
                out.append(f"{n}: {m.group(0)}")
    return out
