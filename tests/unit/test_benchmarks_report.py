"""docs/benchmarks.md is a report: short, it links every bench and every lab-notes file, and every link in
it, in the lab notes (docs/lab/) and in the README lands on a file and heading that exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.markdown import LINK, broken_links, links

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "docs" / "benchmarks.md"
NOTES = ROOT / "docs" / "lab"


def test_report_is_short():
    assert len(REPORT.read_text().splitlines()) <= 450


def test_every_bench_is_linked_from_the_report():
    targets = {target for _, target in links(REPORT)}
    missing = [p.name for p in sorted((ROOT / "bench").glob("*.py")) if f"../bench/{p.name}" not in targets]
    assert not missing, f"benches not linked from docs/benchmarks.md: {missing}"


def test_every_lab_notes_file_is_linked_from_the_report():
    targets = {target.split("#")[0] for _, target in links(REPORT)}
    missing = [p.name for p in sorted(NOTES.glob("*.md")) if f"lab/{p.name}" not in targets]
    assert not missing, f"lab notes not linked from docs/benchmarks.md: {missing}"


def test_simulated_figures_say_so_where_shown():
    shown = [(alt, target) for alt, target in LINK.findall(REPORT.read_text()) if target.endswith(".png")]
    assert shown
    for alt, target in shown:
        assert (ROOT / "docs" / target).exists(), target
        if "-sim-" in target:
            assert "SIMULATED" in alt, f"{target} is simulated; its caption must say SIMULATED"


@pytest.mark.parametrize("doc", [ROOT / "README.md", REPORT, *sorted(NOTES.glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"
