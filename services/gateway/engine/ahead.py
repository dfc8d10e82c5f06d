"""One step ahead (`--async-scheduling`): a replica's next pass planned and sent while its pass runs.

On by default (auto) for a replica whose pass runs on a GPU, as its Stats say (`ahead_on`): there the host's
cores are free while the pass runs. On a CPU target the gateway's work beside the pass takes a core from it
(at one SmolLM2 request on the 2-core development machine the flag cost 5-9 %), so auto leaves it off there;
`on` forces it (a near-null target at 64 in flight: 1.2-1.5x `none`'s tokens/s).

As vLLM's async scheduling and SGLang's overlap scheduler do, the step loop plans pass N+1, builds it
and sends it before pass N's reply is in; it commits N's outputs while the target computes N+1, whose
call waits in order behind N's on the replica's connection. A decoding request whose entry in N is in
flight sends an entry whose root the target fills in (`VerifyEntry.root_pending`: its newest
committed token, the one N emits), at N's committed count plus one; a request whose prompt chunk is in
flight sends its next chunk from where that one ends. What the gateway cannot know yet is left out of
N+1: a request whose token in flight is its last by max_tokens sends nothing, nor does one whose last
prompt chunk is in flight (it decodes once its first token is in). A request that ends at N's token (a
stop id, a stop string) computed one more token in N+1, which is dropped.

**Chains ahead.** A request that speculates with a chain (beam width 1) goes ahead too. One whose entry in flight
is known in full (sent with its root known) is drafted from its root as in any step. One whose entry in flight
waits on the pass before it has its draft grow a chain from a guess of that entry's answer (its chain accepted
whole: `SentAhead.path`, known once the pass before it is committed), one level deeper, the first level the guess
of its bonus token, as drafting ahead does (overlap.py; `DraftCalls.ahead_items`); the draft call runs while the
pass in flight does. The entry sent is that chain under its placeholder root, with the guess's length
(`VerifyEntry.guess`): the target verifies the chain under the bonus it guessed where the guess came true, and the
root alone otherwise (`guessed_tree`). Either way the step emits a token at least, as a root-only step would; a
wrong guess costs the draft's work, not a pass. When the pass before is committed the gateway works out which came
true, as the target will (`resolve`): the entry's record is made that of a root-only step where the guess was
wrong, so that the policies and the cost model see what was verified.

A pass runs ahead only when it holds nothing that depends on N's answer but the above: every decoding request
is planned root-only or a chain, none has a grammar, the plan preempts nobody and keeps the draft
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

from specserve.gateway.engine.request import GenRequest, SentAhead
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import IterationPlan, Residency
from specserve.gateway.sched.policy.base import CandidateTree
from specserve.shared.spec.token_tree import guessed_tree


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
        if r.grammar is not None or (shape is not None and shape.depth > 0 and shape.width != 1):
            return False
    return True


def under_guesses(trees: dict[str, CandidateTree], roots: dict[str, int]) -> dict[str, int]:
    """The trees drafted on a guess (`roots`) made the subtree under their likeliest first-level child (the
    guessed bonus token), in place; returns each one's placeholder root (a tree with no child is dropped)."""
    placeholders: dict[str, int] = {}
    for rid in roots:
        tree = trees.get(rid)
        if tree is None:
            continue
        if not tree.children[0]:
            del trees[rid]
            continue
        trees[rid] = tree.rerooted(max(tree.children[0], key=lambda v: tree.path_prob[v]))
        placeholders[rid] = tree.tokens[0]
    return placeholders


def decode_entry(r: GenRequest, step: int, tokens: list[int], parents: list[int],
                 placeholder: int | None) -> SentAhead | None:
    """A decoding request's entry at `step` in a pass sent ahead, its entry in flight from now on: `tokens`,
    `parents` its selected tree (its root alone: its newest token); with an entry in flight, its root is filled
    in by the target, and a tree drafted on a guess (`placeholder`: its root) goes under that root. None where
    its token in flight is its last."""
    sent = r.sent_ahead if r.ahead_step else None
    if sent is not None:
        if len(r.output) + 1 >= r.max_tokens:
            return None
        if placeholder is None or sent.path is None or len(tokens) == 1:  # its root alone, after any answer of
            span = len(sent.path) if sent.path is not None else len(sent.tokens)  # the entry in flight (its drafts)
            r.sent_ahead = SentAhead(step, r.committed + 1, span, True, tokens[:1], [-1], [])
        else:
            r.sent_ahead = SentAhead(step, r.committed + 1, len(sent.path), True, [placeholder, *tokens],
                                     [-1, *(q + 1 for q in parents)], None)
    else:  # (a tree drafted on a guess whose pass was committed while it was drafted: kept where its root is right)
        if placeholder is not None and tokens[0] != r.output[-1]:
            tokens, parents = [r.output[-1]], [-1]
        r.sent_ahead = SentAhead(step, r.committed, 0, False, tokens, parents, tokens[1:])
    r.ahead_step = step
    return r.sent_ahead


def resolve(r: GenRequest, step: int) -> None:
    """The request's output of `step` is committed: its entry sent ahead of it on a guess of that output
    (`SentAhead`) becomes what the target verifies (`guessed_tree`), its record's entry that of a root-only
    step where the guess was wrong."""
    sent = r.sent_ahead
    if sent is None or sent.step <= step or not sent.pending or sent.path is not None:
        return
    picked = guessed_tree(sent.tokens, sent.parents, sent.base, sent.guess, r.committed, r.output[-1])
    sent.path = picked[0][1:] if picked is not None else []
    if sent.counts is not None:
        sent.counts.guess_hits += bool(sent.path)
    if sent.entry is not None and not sent.path:
        sent.entry.depth, sent.entry.width, sent.entry.verified, sent.entry.filler = 0, 1, 1, 0


def settle(r: GenRequest, step: int, ok: bool) -> bool:
    """The request's output of `step` arrived (`ok`: without an error): False where it is to be dropped (sent
    on a state that did not come true). An entry of a later step still in flight (a decode step or the next
    prompt chunk) is dropped in turn when this one failed."""
    if step <= r.void_step:
        return False
    newest = max(r.ahead_step, r.chunk_step)
    if not ok and newest > step:
        r.void_step, r.ahead_step, r.chunk_step, r.sent_ahead = newest, 0, 0, None
        return True
    if r.chunk_step == step:
        r.chunk_step = 0
    if r.ahead_step == step:
        r.ahead_step, r.sent_ahead = 0, None
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
    r.sent_ahead = None


__all__ = ["InFlight", "decode_entry", "queued_ms", "resolve", "runs_ahead", "settle", "under_guesses", "unbound"]
