"""`specserve profile`: the knee rule, and a quick measurement through a real target service.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_profile.py.
"""

from __future__ import annotations

import asyncio

import pytest

from specserve.cli.main import BUNDLED_TARGET
from specserve.gateway.perf.profile import (
    MIN_DECODE_PASSES,
    SINGLE_SIZES,
    Profile,
    format_table,
    knee,
    measure,
)
from specserve.shared.host.launch import ServiceProcess
from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.wire.service_client import TargetClient


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
            # two prefills (the batch, the lone request), decode passes, 2 rounds of 2 sizes and 4 lone chains
            assert bounded.calls == 2 + MIN_DECODE_PASSES + 2 * (2 + len(SINGLE_SIZES))
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
    assert [n for n, _ in profile.single] == list(SINGLE_SIZES) and all(ms > 0 for _, ms in profile.single)
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
    assert isinstance(loaded.curve[0], tuple) and isinstance(loaded.single[0], tuple)
    assert "a lone request's chain: 1 nodes" in format_table(profile)
    assert f"[8, {profile.curve[0][1]}]" in path.read_text()  # one line per point
    weird = Profile(**{**vars(profile), "model": 'dir [\n  1,\n  2\n] "x"'})
    assert Profile.load(weird.save(tmp_path / "weird.json")) == weird
