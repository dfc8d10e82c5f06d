"""The gateway's engine in the test's own process, against real draft and target services: a test
policy on the real chain policy that moves the draft or turns speculation off on chosen iterations
(Steered), the engine serving prompts under it (serve), the reference it must give
(reference_tokens) and the check that both services hold nothing afterwards (idle)."""

from __future__ import annotations

import asyncio

from specserve.gateway.backends.pool import DraftService, ServicePool, TargetReplica
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.loop import Engine
from specserve.gateway.engine.request import Finished, GenRequest, Tokens
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.perf.cost import PassCost
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import Decision, Residency, SchedulerView, Shape
from specserve.gateway.sched.policy.fixed import Chain
from specserve.gateway.sched.routing import RoundRobin
from specserve.gateway.sched.scheduler import Scheduler
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.wire.messages import SamplingSpec
from specserve.shared.wire.service_client import DraftClient, TargetClient
from tests.support.gateway import PROMPTS, TARGET

MAX_TOKENS = 30


def reference_tokens() -> tuple[list[tuple[list[int], list[int]]], set[int]]:
    """The first three PROMPTS as token ids, each with the target's greedy continuation (MAX_TOKENS tokens,
    with transformers), and the target's stop ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype="float32").eval()
    out = []
    for p in PROMPTS[:3]:
        ids = tok(p, return_tensors="pt")["input_ids"]
        gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return out, set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                    else [model.generation_config.eos_token_id])


class Steered(Chain):
    """chain:3, plus a residency change or d = 0 on chosen iterations; keeps every record."""

    def __init__(self, residency: dict[int, Residency] | None = None, off_every: int = 0):
        super().__init__(3)
        self.residency = residency or {}
        self.off_every = off_every
        self.calls = 0
        self.records: list[IterationRecord] = []

    def decide(self, view: SchedulerView) -> Decision:
        decision = super().decide(view)
        self.calls += 1
        decision.residency = self.residency.get(self.calls, Residency.KEEP)
        if self.off_every and self.calls % self.off_every:
            decision.shapes = {rid: Shape(0, 1) for rid in decision.shapes}  # speculation off this iteration
        return decision

    def observe(self, record: IterationRecord) -> None:
        self.records.append(record)


async def serve(policy: Steered, services, prompts, stops, *, sync: bool, overlap: bool = False,
                draft_misses: bool = False, abort: int | None = None, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The engine in this process on `services` (a target and a draft: tests/support/fixtures.py's
    start_services) serving `prompts` greedily under `policy`; each request's tokens. abort: the index of
    a request to abort once its first tokens arrive (its output is cut there)."""
    target, draft = services
    pool = ServicePool([TargetReplica(0, target.address, PassCost(16, 10.0))], DraftService(draft.address))
    engine = Engine(policy, Scheduler(policy, RoundRobin(), sync_draft=sync), pool, GatewayMetrics("t"),
                    GatewayConfig(overlap=overlap, overlap_miss="draft" if draft_misses else "root"))
    await engine.start()
    try:
        reqs = [GenRequest(f"r{i}", ids, SamplingSpec(), max_tokens, SloClass("chat", 100.0, 5000.0),
                           frozenset(stops)) for i, (ids, _) in enumerate(prompts)]
        for r in reqs:
            engine.intake.submit(r)

        async def collect(r: GenRequest) -> list[int]:
            out: list[int] = []
            while True:
                event = await r.events.get()
                if isinstance(event, Tokens):
                    out += event.tokens
                    if abort is not None and r is reqs[abort]:
                        engine.intake.abort(r.rid)  # the engine is in its next pass: aborted mid-step
                        return out
                elif isinstance(event, Finished):
                    assert event.reason in ("stop", "length"), event
                    return out

        return list(await asyncio.gather(*(collect(r) for r in reqs)))
    finally:
        await engine.close()


async def idle(services) -> None:
    """Both services hold no request and no KV block (asserted, at once)."""
    target, draft = services
    for cls, address in ((TargetClient, target.address), (DraftClient, draft.address)):
        c = await cls.connect(address)
        s = await c.stats()
        await c.close()
        assert s.resident_requests == 0 and s.free_blocks == s.total_blocks, s
