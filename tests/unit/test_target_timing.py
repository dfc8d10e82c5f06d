"""The target's reply times its model pass alone: building the pass's inputs is the service's own work."""

from __future__ import annotations

import time

import torch

import specserve.shared.runtime.runner as runner_module
from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine

SLOW_MS = 60.0


def test_the_replys_forward_ms_is_the_model_call_without_building_its_inputs(monkeypatch) -> None:
    engine = TargetEngine(TargetConfig(kv_blocks=32, threads=1))
    assert engine.runner.inputs_for == "lean"  # the compiled CPU pass, which builds its inputs per call
    build = runner_module.build_lean_inputs

    def slow_build(*args, **kwargs):  # inputs that take SLOW_MS to build
        time.sleep(SLOW_MS / 1e3)
        return build(*args, **kwargs)

    monkeypatch.setattr(runner_module, "build_lean_inputs", slow_build)
    prompt = [72, 400, 1201, 33, 9, 870]
    msg = Forward(prefill=[PrefillEntry("a", 1, 0, len(prompt), True, SamplingSpec(temperature=0.0))])
    reply, payload = engine.forward(msg, {"prefill_tokens": torch.tensor(prompt, dtype=torch.int32)})
    assert reply.results[0].error is None and len(payload["tokens"]) == 1
    assert reply.total_ms >= SLOW_MS  # the call holds the slow inputs
    assert 0 < reply.forward_ms == engine.runner.model_ms
    assert reply.forward_ms < reply.total_ms - SLOW_MS  # the pass does not
