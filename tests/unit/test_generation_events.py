"""`Generation` (services/gateway/http/api.py) turns a request's engine events into text: whatever
batches the events arrive in, it ends, and it keeps the engine's report."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from specserve.gateway.engine.request import Admitted, Finished, Submission, Tokens
from specserve.gateway.http.api import Generation
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.wire.messages import SamplingSpec

TARGET = Path(__file__).resolve().parents[2] / "models" / "target"


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TARGET))


class QueuedEngine:
    """The EngineApi a Generation uses, with the request's events queued up front: the engine has
    already ended the request when the handler first looks (its Finished follows its last Tokens)."""

    classes: dict = {}

    def __init__(self, events):
        self.events, self.aborted = events, []

    def submit(self, sub):
        queue: asyncio.Queue = asyncio.Queue()
        for event in self.events:
            queue.put_nowait(event)
        return queue

    def abort(self, rid, reason="abort"):
        self.aborted.append((rid, reason))  # the request is over already: no second Finished comes


async def collect(gen: Generation) -> str:
    await gen.admitted()
    return "".join([piece async for piece in gen.pieces()])


@pytest.mark.parametrize("stop_at_last", [False, True])
def test_stop_string_in_the_batch_that_holds_finished(tokenizer, stop_at_last):
    """A stop string matched in the same batch of events as the engine's Finished: the text ends at
    the stop string, and the report is the Finished's (before, the handler waited forever for another)."""
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    stop = "four" if stop_at_last else "two"
    report = {"replica": 0, "steps": []}
    engine = QueuedEngine([Admitted(0), Tokens(ids), Finished("length", report=report)])
    sub = Submission("r1", tokenizer.encode("Count:"), SamplingSpec(), len(ids), SloClass("t", 100.0, 1000.0),
                     frozenset())
    gen = Generation(engine, sub, tokenizer, (stop,))
    text = asyncio.run(asyncio.wait_for(collect(gen), timeout=30))
    assert text == (" one two three " if stop_at_last else " one ")
    assert gen.finish_reason == "stop" and gen.report == report
    assert engine.aborted == [("r1", "stop")]
