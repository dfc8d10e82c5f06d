"""The training corpus: CPython's own standard library sources (Lib/*.py of the running interpreter).

Split deterministically by path: a file whose relative path hashes into bucket 0 of 10 is held out
and never trained on. The split depends only on the path, so it is the same on every machine.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_BUCKETS = 10  # 1 bucket of 10 held out: 10% of files


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to Lib/, POSIX separators
    text: str

    @property
    def held_out(self) -> bool:
        return is_held_out(self.path)


def is_held_out(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_BUCKETS == 0


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _wanted(rel: Path) -> bool:
    # site-packages is not the standard library; _sysconfigdata_* is generated per build.
    return "site-packages" not in rel.parts and not rel.name.startswith("_sysconfigdata")


def load_corpus(root: Path | None = None) -> tuple[list[SourceFile], list[str]]:
    """All readable Lib/**/*.py files, sorted by path, and the paths skipped (not UTF-8)."""
    root = root or stdlib_dir()
    files, skipped = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if not _wanted(rel) or not p.is_file():
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel.as_posix())
            continue
        files.append(SourceFile(rel.as_posix(), text))
    if not files:
        raise RuntimeError(f"no Python sources found under {root}")
    return files, skipped


def fingerprint(files: list[SourceFile]) -> str:
    """sha256 over (path, text) of every file: equal fingerprints mean equal corpora."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.path.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()
