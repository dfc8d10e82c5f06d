"""Every Markdown file under docs/ (the lab notes included) and README.md, against the tree:

- every relative link lands on a file and heading that exist;
- every repository path it names (`services/...`, `bench/results/...`, `docs/lab/...`) exists; a path cut
  short by a placeholder or a wildcard (`bench/results/sweep-<name>/`) names a family that must have a
  member;
- it carries no issue numbers and no commit ids: the docs say what a change was, not where it was
  tracked (result files named after a commit are paths, not references, and pass).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.markdown import broken_links, history_refs, missing_repo_paths

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _id(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_the_docs_are_found():
    names = {_id(p) for p in DOCS}
    assert {"README.md", "docs/benchmarks.md", "docs/architecture.md", "docs/lab/admission.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_links_resolve(doc):
    broken = broken_links(doc)
    assert not broken, f"{_id(doc)}: broken links {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_repository_paths_exist(doc):
    missing = missing_repo_paths(doc)
    assert not missing, f"{_id(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_no_issue_numbers_or_commit_ids(doc):
    found = history_refs(doc)
    assert not found, f"{_id(doc)} names issues or commits (line: text): {found}"


def test_the_history_check_sees_what_it_must(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("\n".join([
        "Fixed in issue 48, see #48 (stop 55).",                       # 1: three
        "Measured on 5b034e9, then a9c839e and 0123abcd4567.",          # 2: three
        "A link [there](other.md#why-it-loses-issue-48-simulated).",   # 3: an anchor naming an issue
        "Issues 6 and 19.",                                             # 4
    ]))
    found = history_refs(doc)
    assert [f.split(":")[0] for f in found] == ["1", "1", "1", "2", "2", "2", "3", "4"], found


def test_the_history_check_lets_other_hex_and_numbers_pass(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("\n".join([
        "Colour #a1b2c3, 1234567 tokens, deadbeef, 0x1f2e3d4c5b, a sha256 of "
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08.",
        "See [section 1](#1-one-request-at-a-time) and &#39;quoted&#39;; 1e-5, 2.9e-6, float16.",
        "Results: `bench/results/cost_error-a2ede53.json` and bench/results/admission/history/x-655a5dd.json.",
    ]))
    assert history_refs(doc) == []


def test_the_path_check_sees_a_dead_path_and_lets_families_pass(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("\n".join([
        "The old `services/gateway/cost.py` and [this](services/gateway/policy/joint.py).",
        "Alive: `services/gateway/perf/cost.py`, `bench/results/sweep-<name>/sweep.json`,",
        "`bench/results/history/kv-lad-tried-*.json`, `bench/results/sim_scale_profile/before-b{1,32}.json`.",
        "A family with no member: `bench/results/no-such-prefix-*.json`.",
    ]))
    assert missing_repo_paths(doc) == ["bench/results/no-such-prefix-", "services/gateway/cost.py",
                                       "services/gateway/policy/joint.py"]
