"""`specserve profile`: the knee rule, and a quick measurement through a real target service.

Here: the tests that start no process and open no socket; the others are in tests/service/test_profile.py.
"""

from __future__ import annotations

import argparse

import pytest

from specserve.cli.main import BUNDLED_TARGET
from specserve.gateway.perf.profile import (
    add_flags,
    default_profile_path,
    knee,
)


def test_knee_flat_then_rising():
    # reference 10 ms, ratio 1.25 -> limit 12.5 ms: 64 tokens (12.4) is the last point under it
    curve = [(8, 10.2), (16, 10.9), (32, 11.5), (64, 12.4), (128, 19.0), (256, 35.0)]
    assert knee(curve, 10.0, 1.25) == 64
    assert knee(list(reversed(curve)), 10.0, 1.25) == 64  # any order
    assert knee(curve, 10.0, 2.0) == 128
    assert knee(curve, 10.0, 1.0) == 8  # 10.2 > 10.0: nothing passes
    assert knee([(8, 10.0), (16, 12.5)], 10.0, 1.25) == 16  # the limit itself passes


def test_knee_is_never_below_eight():
    assert knee([(8, 30.0), (16, 40.0)], 10.0, 1.25) == 8
    assert knee([], 10.0, 1.25) == 8
    assert knee([(1, 1.0), (2, 1.0), (4, 1.0), (6, 100.0)], 10.0, 1.25) == 8  # small counts that pass


def test_knee_stops_at_the_first_failure():
    # 48 tokens fails; 64 dips back under the limit but is past the first failure
    curve = [(8, 10.0), (16, 11.0), (32, 12.0), (48, 13.0), (64, 12.0), (128, 12.2)]
    assert knee(curve, 10.0, 1.25) == 32


def test_knee_rejects_bad_input():
    with pytest.raises(ValueError):
        knee([(8, 1.0)], 0.0, 1.25)
    with pytest.raises(ValueError):
        knee([(8, 1.0)], 1.0, 0.9)


def test_default_profile_path(tmp_path):
    path = default_profile_path(tmp_path / "models" / "llama", "cuda:0")
    assert path.name == "profile-llama-cuda-0.json"
    assert path.parent.name == "specserve" and path.parent.parent.name == ".cache"
    keyed = {default_profile_path(tmp_path / "models" / "llama", "cuda:0", f) for f in ("a", "b", "a")}
    assert len(keyed) == 2 and all(p.name.startswith("profile-llama-cuda-0-") for p in keyed)


def test_the_latency_fingerprint_changes_with_what_sets_pass_time(tmp_path):
    """Two targets whose passes differ get different profiles: model files, dtype, threads, pass, preset and
    its time scale each change the fingerprint; the same target gives the same one."""
    import os
    import shutil

    from specserve.shared.host.service_base import latency_fingerprint
    from specserve.target.config import TargetConfig

    model = tmp_path / "target"
    shutil.copytree(BUNDLED_TARGET, model)

    def fp(**kw) -> str:
        config = TargetConfig(**({"model": str(model), "threads": 1} | kw))
        return latency_fingerprint(config, "cpu", "float32")

    base = fp()
    assert base == fp() and "threads=1" in base
    variants = [fp(threads=2), fp(kernels="torch"), fp(weights="q8_0"), fp(activations="float32"),
                fp(activations="int8"), fp(simulate="llama2-7b-a100"),
                fp(simulate="llama2-7b-a100,time_scale=4"), fp(simulate="cpu-demo")]
    assert len({base, *variants}) == 1 + len(variants)
    assert latency_fingerprint(TargetConfig(model=str(model), threads=1), "cpu", "bfloat16") != base
    weights = model / "config.json"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rewritten
    assert fp() != base


def test_flags_parse():
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--target", "127.0.0.1:9", "--quick", "--knee-ratio", "1.5", "--out", "p.json"])
    assert args.target == "127.0.0.1:9" and args.quick and args.knee_ratio == 1.5 and args.out == "p.json"
    assert args.model is None and args.device is None and args.threads >= 1
