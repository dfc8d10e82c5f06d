"""The target's call by batch (shared/wire/messages.py): a Forward's verify entries and its reply's results
travel as columns, read back as the rows they were built from; columns that disagree with the request ids
refuse the call."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from specserve.shared.host.service_base import BadCall
from specserve.shared.wire.messages import (
    ErrorInfo,
    Forward,
    ForwardReply,
    Message,
    PrefillEntry,
    ResultColumns,
    SamplingSpec,
    StepResult,
    VerifyColumns,
    VerifyEntry,
    column,
)
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine

ENTRIES = [VerifyEntry("a", 7, 21, 1), VerifyEntry("b", 2**40, 3, 5, masked=True),
           VerifyEntry("c", 9, 2**33, 1, root_pending=True), VerifyEntry("d", 1, 1, 2, True, True, guess=3)]
RESULTS = [StepResult("a", 7, 1, 0), StepResult("b", 8, 0, 0, ErrorInfo("stale_step", "old")),
           StepResult("c", 9, 3, 2, num_features=3, num_cached=16, num_prompt_logprobs=4, num_logprobs=3,
                      top_logprobs=2), StepResult("d", 1, 1, 0, num_cached=5)]


def _wire(message: msgspec.Struct) -> Message:
    decoded: Message = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=Message)
    return decoded


def test_verify_entries_and_results_come_back_as_the_rows_they_were_built_from():
    forward = _wire(Forward(verify=ENTRIES, release=["z"]))
    assert isinstance(forward, Forward) and isinstance(forward.verify, VerifyColumns)
    assert forward.verify.entries() == ENTRIES and len(forward.verify) == 4 and forward.release == ["z"]
    reply = _wire(ForwardReply(RESULTS, 1.5, 0.5, 2.5, 10))
    assert isinstance(reply, ForwardReply) and isinstance(reply.results, ResultColumns)
    assert list(reply.results) == RESULTS and reply.results[2] == RESULTS[2] and len(reply.results) == 4
    assert reply.results[-1] == RESULTS[-1] and reply.results[1] == RESULTS[1]  # one row alone, errors kept
    assert set(reply.results.errors) == {1} and set(reply.results.extra) == {2, 3}  # only the rows that have any
    assert _wire(Forward()).verify.entries() == [] and list(_wire(ForwardReply([], 0, 0, 0, 0)).results) == []
    assert Forward(verify=ENTRIES[:3]).verify.guesses == b""  # no entry drafted on a guess: no column


def test_columns_that_disagree_with_the_request_ids_refuse_the_call():
    engine = TargetEngine(TargetConfig(kv_blocks=64, threads=1))
    prompt = torch.arange(5, 13, dtype=torch.int32)
    reply, _ = engine.forward(Forward([PrefillEntry("a", 1, 0, 8, True, SamplingSpec())]), {"prefill_tokens": prompt})
    assert list(reply.results)[0].error is None
    good = VerifyColumns.of([VerifyEntry("a", 2, 9, 1)])
    short = msgspec.structs.replace(good, steps=column([2, 3], np.int64))  # two steps for one request
    root = {"tree_tokens": torch.tensor([engine.requests["a"].last_token], dtype=torch.int32),
            "tree_parents": torch.tensor([-1], dtype=torch.int32)}
    with pytest.raises(BadCall, match="column 'steps'"):
        engine.forward(Forward(verify=short), root)
    with pytest.raises(BadCall, match="column 'flags'"):
        engine.forward(Forward(verify=msgspec.structs.replace(good, flags=b"")), root)
    with pytest.raises(BadCall, match="column 'guesses'"):
        engine.forward(Forward(verify=msgspec.structs.replace(good, guesses=column([1, 2], np.int32))), root)
    reply, out = engine.forward(Forward(verify=good), root)  # refused whole, the request is where it was
    assert list(reply.results)[0].error is None and out["tokens"].numel() == 1
