"""deploy/kubernetes as kubectl kustomize renders it (or the files kustomization.yaml lists), and a lookup in it."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from tests.support.compose import ROOT

KUSTOMIZE = ROOT / "deploy/kubernetes"


def rendered() -> list[dict]:
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(KUSTOMIZE)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    kustomization = yaml.safe_load((KUSTOMIZE / "kustomization.yaml").read_text())
    return [d for f in kustomization["resources"] for d in yaml.safe_load_all((KUSTOMIZE / f).read_text()) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)
