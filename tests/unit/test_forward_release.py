"""A Forward frees the requests it names before its pass (`Forward.release`), as a Release call would."""

from __future__ import annotations

import torch

from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine

PROMPT = [72, 400, 1201, 33, 9, 870, 41, 5, 77, 1024, 3, 18, 260, 99, 7, 640, 12]
TENSORS = {"prefill_tokens": torch.tensor(PROMPT, dtype=torch.int32)}


def _prefill(rid: str, step: int) -> PrefillEntry:
    return PrefillEntry(rid, step, 0, len(PROMPT), True, SamplingSpec(temperature=0.0))


def test_a_forward_releases_before_its_pass_so_a_request_may_start_again_in_it() -> None:
    engine = TargetEngine(TargetConfig(kv_blocks=32, threads=1))
    total = engine.free_blocks()
    first, first_token = engine.forward(Forward(prefill=[_prefill("a", 1)]), TENSORS)
    assert first.results[0].error is None and first.free_blocks < total

    # without the release, prefilling "a" from its start again is refused: it is in the middle of its output
    refused, _ = engine.forward(Forward(prefill=[_prefill("a", 2)]), TENSORS)
    assert refused.results[0].error is not None

    # released first (an unknown id beside it is ignored), the same call starts it again: the same first token
    again, token = engine.forward(Forward(prefill=[_prefill("a", 3)], release=["a", "never-seen"]), TENSORS)
    assert again.results[0].error is None and again.free_blocks == first.free_blocks
    assert token["tokens"].tolist() == first_token["tokens"].tolist()

    # a call that passes another request frees the one it names
    other, _ = engine.forward(Forward(prefill=[_prefill("b", 1)], release=["a"]), TENSORS)
    assert other.results[0].error is None and other.free_blocks == first.free_blocks
    assert set(engine.requests) == {"b"}
