"""A step loop that drives the draft and target services (started with specserve.shared.host.launch).

The loop is a test client, deliberately plain: prefill in chunks, speculate for every decoding
request, verify every candidate node, commit what the target emits. It is what the gateway does,
minus the policy (shapes rotate through a fixed list, so every call mixes several of them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from specserve.shared.wire.messages import SamplingSpec
from specserve.shared.wire.service_client import (
    DraftClient,
    PrefillItem,
    SpeculateItem,
    TargetClient,
    VerifyItem,
)

SHAPES = [(0, 1), (1, 1), (3, 2), (4, 4), (2, 3), (6, 1)]  # (depth, width) rotated per request and step


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_new: int
    join_step: int = 0  # the drive step at which its prefill starts
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # committed tokens the draft has not seen yet
    accepted: list[int] = field(default_factory=list)  # accepted draft nodes per tree step
    done: bool = False

    @property
    def committed(self) -> int:
        return len(self.prompt) + len(self.output)


async def drive(draft: DraftClient, target: TargetClient, reqs: list[Req], stop_ids: set[int],
                chunk: int = 64, hook: Callable[[int], Awaitable[None]] | None = None) -> dict[str, list[int]]:
    """Greedy speculative generation of every request through both services; returns the outputs."""
    step = 0
    while not all(r.done for r in reqs):
        step += 1
        if hook is not None:
            await hook(step)
        prefill = []
        for r in reqs:
            if r.join_step <= step and r.prefilled < len(r.prompt):
                toks = r.prompt[r.prefilled : r.prefilled + chunk]
                last = r.prefilled + len(toks) == len(r.prompt)
                prefill.append(PrefillItem(r.rid, step, r.prefilled, toks, last,
                                           SamplingSpec() if r.prefilled == 0 else None))
        decoding = [r for r in reqs if r.output and not r.done]
        items = []
        for i, r in enumerate(decoding):
            depth, width = SHAPES[(i + step) % len(SHAPES)]
            depth = min(depth, r.max_new - len(r.output))
            items.append(SpeculateItem(r.rid, step, r.unsent, r.committed, depth, width))
        candidates, _ = await draft.speculate(items) if items else ([], None)
        verify = []
        for r, cand in zip(decoding, candidates):
            assert cand.error is None, cand.error
            r.unsent = []
            verify.append(VerifyItem(r.rid, step, r.committed, cand.tokens, cand.parents))
        outputs, _ = await target.forward(prefill, verify)
        by_rid = {r.rid: r for r in reqs}
        for out in outputs:
            assert out.error is None, out.error
            r = by_rid[out.rid]
            if not out.tokens:  # a prefill chunk that was not the last
                r.prefilled += chunk
                continue
            if not r.output:
                r.prefilled = len(r.prompt)
                r.unsent = list(r.prompt)
            else:
                r.accepted.append(out.num_accepted)
            for token in out.tokens:
                r.output.append(token)
                r.unsent.append(token)
                if token in stop_ids or len(r.output) >= r.max_new:
                    r.done = True
                    break
    done = [r.rid for r in reqs]
    await draft.release(done)
    await target.release(done)
    return {r.rid: r.output for r in reqs}
