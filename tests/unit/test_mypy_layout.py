"""mypy sees the package through the symlinks in .mypy_path/specserve/ (pyproject.toml's [tool.mypy] says
why), so `mypy -p specserve` checks only what is linked there: every module and package of services/
needs its link, and shared/ its own."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINKS = ROOT / ".mypy_path" / "specserve"


def package_entries(folder: Path) -> list[str]:
    """The *.py files and the package folders directly in `folder` (not __pycache__ or hidden ones)."""
    return sorted(p.name for p in folder.iterdir()
                  if not p.name.startswith((".", "__pycache__"))
                  and ((p.is_file() and p.suffix == ".py") or (p.is_dir() and any(p.glob("*.py")))))


def test_every_module_of_services_is_linked_for_mypy():
    expected = {name: ROOT / "services" / name for name in package_entries(ROOT / "services")}
    expected["shared"] = ROOT / "shared"
    missing = sorted(name for name in expected if not (LINKS / name).is_symlink())
    assert not missing, (f"not linked in .mypy_path/specserve/, so mypy skips them: {missing}; add each with "
                         f"`ln -s ../../services/NAME .mypy_path/specserve/NAME` (and git add it)")
    wrong = sorted(name for name, target in expected.items() if (LINKS / name).resolve() != target.resolve())
    assert not wrong, f"links in .mypy_path/specserve/ that point elsewhere: {wrong}"
    stale = sorted(p.name for p in LINKS.iterdir() if p.name not in expected)
    assert not stale, f"links in .mypy_path/specserve/ to nothing in services/ or shared/: {stale}"
