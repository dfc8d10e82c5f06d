"""One step ahead (`--async-scheduling`): a replica's next pass planned and sent while its pass runs.

On by default (auto) for a replica whose pass runs on a GPU, as its Stats say (`ahead_on`): there the host's
cores are free while the pass runs. On a CPU target the gateway's work beside the pass takes a core from it
(at one SmolLM2 request on the 2-core development machine the flag cost 5-9 %), so auto leaves it off there;
`on` forces it (a near-null target at 64 in flight: 1.2-1.5x `none`'s tokens/s).

As vLLM's async scheduling and SGLang's overlap scheduler do, the step loop plans pass N+1, builds it
and sends it before pass N's reply is in; it commits N's outputs while the target computes N+1, whose
call waits in order behind N's on the replica's connection. A decoding request whose entry in N is in
flight sends a root-only entry whose root the target fills in (`VerifyEntry.root_pending`: its newest
committed token, the one N emits), at N's committed count plus one; a request whose prompt chunk is in
flight sends its next chunk from where that one ends. What the gateway cannot know yet is left out of
N+1: a request whose token in flight is its last by max_tokens sends nothing, nor does one whose last
prompt chunk is in flight (it decodes once its first token is in). A request that ends at N's token (a
stop id, a stop string) computed one more token in N+1, which is dropped.

A pass runs ahead only when it holds nothing that depends on N's answer: every decoding request is
planned root-only (no draft tree), none has a grammar, the plan preempts nobody and keeps the draft
where it is (`runs_ahead`); otherwise the loop commits N first and then carries out the plan it made
(planning again would show the policies the step twice: a probe the first plan spent would be lost),
passing over what N's commit ended or moved (`Admitter.apply`, `Passes.build`). Where N's entry for a
request did not come true (an error that does not end it, such as `out_of_blocks`, retried), its
entry in N+1 (a decode step, or its next chunk) was sent on a state the target does not have; the
target refuses it (out of sync) and its output is dropped (`settle`). A request taken off its replica
(a replica lost) drops what it had in flight (`unbound`). A pass sent ahead is timed from when the one
before it was answered (`queued_ms`), so that the cost model does not count its wait in line as a
round trip.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from specserve.gateway.engine.request import GenRequest
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import IterationPlan, Residency


@dataclass(slots=True)
class InFlight:
    """A replica's pass sent ahead: its call (which commits its outputs when the reply is in), its record."""

    task: asyncio.Task[None]
    record: IterationRecord
    t0: float  # perf_counter when its iteration began


def ahead_on(mode: str, device: str) -> bool:
    """Whether a replica's passes may go ahead under `--async-scheduling mode`: on, off, or auto (on where its
    pass runs on a GPU: on a CPU the gateway's work beside the pass takes a core from it)."""
    return mode == "on" or (mode == "auto" and device == "cuda")


def runs_ahead(plan: IterationPlan, bound: list[GenRequest]) -> bool:
    """The plan's pass may be sent before the pass in flight is committed (see the module's docstring)."""
    if plan.preempt or plan.residency is not Residency.KEEP or plan.draft_sync:
        return False
    for r in bound:
        shape = plan.shapes.get(r.rid)
        if r.grammar is not None or (shape is not None and shape.depth > 0):
            return False
    return True


def decode_entry(r: GenRequest, step: int) -> tuple[int, bool] | None:
    """A decoding request's root-only entry at `step` in a pass sent ahead: its committed count and whether
    the target fills in its root (an entry in flight); None where its token in flight is its last."""
    if r.ahead_step:
        if len(r.output) + 1 >= r.max_tokens:
            return None
        committed, pending = r.ahead_committed, True
    else:
        committed, pending = r.committed, False
    r.ahead_step, r.ahead_committed = step, committed + 1
    return committed, pending


def settle(r: GenRequest, step: int, ok: bool) -> bool:
    """The request's output of `step` arrived (`ok`: without an error): False where it is to be dropped (sent
    on a state that did not come true). An entry of a later step still in flight (a decode step or the next
    prompt chunk) is dropped in turn when this one failed."""
    if step <= r.void_step:
        return False
    newest = max(r.ahead_step, r.chunk_step)
    if not ok and newest > step:
        r.void_step, r.ahead_step, r.chunk_step = newest, 0, 0
        return True
    if r.chunk_step == step:
        r.chunk_step = 0
    if r.ahead_step == step:
        r.ahead_step = 0
    return True


def queued_ms(previous_reply: float, reply: float, call_ms: float) -> float:
    """The part of a call, ms, that it waited behind the replica's pass before it (its reply came at
    `previous_reply`, perf_counter seconds): a pass sent ahead waits in order on the connection, and that
    wait is neither transport nor the target's work. 0 for a pass sent after the one before was answered."""
    return min(call_ms, max(0.0, (previous_reply - (reply - call_ms / 1e3)) * 1e3))


def unbound(r: GenRequest) -> None:
    """The request left its replica: whatever it has in flight there is dropped when it arrives."""
    r.void_step = max(r.void_step, r.ahead_step, r.chunk_step)
    r.ahead_step = r.chunk_step = 0


__all__ = ["InFlight", "decode_entry", "queued_ms", "runs_ahead", "settle", "unbound"]
