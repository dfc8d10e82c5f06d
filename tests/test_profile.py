"""`specserve profile`: the knee rule, and a quick measurement through a real target service."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from specserve.cli.main import BUNDLED_TARGET
from specserve.gateway.perf.profile import (
    MIN_DECODE_PASSES,
    Profile,
    add_flags,
    default_profile_path,
    format_table,
    knee,
    measure,
)
from specserve.shared.host.launch import ServiceProcess
from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.wire.service_client import TargetClient


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


def test_measure_through_a_target_service(tmp_path):
    target = ServiceProcess("target", "--kv-blocks", "256")
    vocab = ModelConfig.from_dir(BUNDLED_TARGET).vocab_size

    class FailingClient(TargetClient):
        """Its 6th forward call fails on the client side, after 5 have committed KV on the target."""

        calls = 0

        async def forward(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 6:
                raise ConnectionError("simulated failure")
            return await super().forward(*args, **kwargs)

    class CountingClient(TargetClient):
        calls = 0

        async def forward(self, *args, **kwargs):
            self.calls += 1
            return await super().forward(*args, **kwargs)

    async def run():
        client = await TargetClient.connect(target.address)
        failing = await FailingClient.connect(target.address)
        bounded = await CountingClient.connect(target.address)
        try:
            profile = await measure(client, output_tokens=16, tree_sizes=(1, 2, 4), repeats=3, vocab_size=vocab,
                                    progress=False)
            stats = await client.stats()
            # without k = 1 in the sizes, the reference decode pass is still measured, but not in the curve
            other = await measure(client, output_tokens=2, tree_sizes=(3,), repeats=1, vocab_size=vocab,
                                  progress=False)
            assert [n for n, _ in other.curve] == [24] and other.reference_ms > 0
            assert other.budget_tokens == knee(other.curve, other.reference_ms, 1.25)
            # a zero time bound: the fewest decode passes, the warm-up and one timed round, counted as such
            cut = await measure(bounded, output_tokens=40, tree_sizes=(1, 2), repeats=5, vocab_size=vocab,
                                progress=False, time_budget_s=0.0)
            assert cut.output_tokens == MIN_DECODE_PASSES
            assert bounded.calls == 1 + MIN_DECODE_PASSES + 2 * 2  # prefill, decode passes, 2 rounds of 2 sizes
            with pytest.raises(ConnectionError):
                await measure(failing, output_tokens=16, tree_sizes=(1, 2), repeats=2, vocab_size=vocab,
                              progress=False)
            return profile, stats, await client.stats()
        finally:
            await client.close()
            await failing.close()
            await bounded.close()

    try:
        profile, stats, after_failure = asyncio.run(run())
        assert target.alive()
    finally:
        assert target.stop() == 0

    for s in (stats, after_failure):  # every request released, also after a failure mid-measurement
        assert s.free_blocks == s.total_blocks == 256, s
        assert s.resident_requests == 0 and s.entry_errors == 0, s
    assert [n for n, _ in profile.curve] == [8, 16, 32]  # batch x k
    assert all(ms > 0 for _, ms in profile.curve)
    assert profile.budget_tokens >= 8 and profile.budget_tokens in (8, 16, 32)
    assert profile.budget_tokens == knee(profile.curve, profile.reference_ms, profile.knee_ratio)
    # the baseline (min of the early decode passes) and the reference (median of later ones) are taken
    # at different times; on a shared machine either can be the larger, so only sanity is checked
    assert 0 < profile.baseline_iteration_ms < 10 * profile.reference_ms
    assert (profile.batch, profile.input_tokens, profile.output_tokens) == (8, 32, 16)
    assert profile.knee_ratio == 1.25
    assert profile.device == "cpu" and profile.dtype == "float32"
    assert profile.model == str(BUNDLED_TARGET)
    assert "<- B" in format_table(profile) or profile.budget_tokens == 8

    path = profile.save(tmp_path / "sub" / "profile.json")
    loaded = Profile.load(path)
    assert loaded == profile
    assert isinstance(loaded.curve[0], tuple)
    assert f"[8, {profile.curve[0][1]}]" in path.read_text()  # one line per point
    weird = Profile(**{**vars(profile), "model": 'dir [\n  1,\n  2\n] "x"'})
    assert Profile.load(weird.save(tmp_path / "weird.json")) == weird
