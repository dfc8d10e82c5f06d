"""The transport tests' echo handler, its health reply, and a runner with a deadline."""

from __future__ import annotations

import asyncio

import torch

from specserve.shared.wire.messages import (
    DraftTree,
    Error,
    Health,
    HealthReply,
    Release,
    Speculate,
    SpeculateReply,
)

HEALTHY = HealthReply("echo", "ok", "none", "cpu", "float32", 0.0)


def run(coro, timeout: float = 5.0):
    """Run a coroutine to completion; a hang fails the test after `timeout` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def echo(body, tensors):
    """Health -> HealthReply; Speculate -> one tree per entry with its tokens + 1 echoed back;
    Release -> raises; anything else -> an Error reply."""
    if isinstance(body, Health):
        return HEALTHY, None
    if isinstance(body, Speculate):
        tokens = tensors["tokens"]
        assert tokens.dtype == torch.int32 and tokens.numel() == sum(e.num_new for e in body.entries)
        trees = [DraftTree(e.rid, e.step, e.num_new, e.depth) for e in body.entries]
        reply = SpeculateReply(trees, catchup_ms=1.5, beam_ms=2.5, total_ms=4.0, forwards=len(trees), free_blocks=9)
        out = {
            "tokens": tokens + 1,
            "parents": torch.arange(tokens.numel(), dtype=torch.int32) - 1,
            "path_prob": tokens.to(torch.float32) / 4,
        }
        return reply, out
    if isinstance(body, Release):
        raise RuntimeError(f"release of {body.rids} exploded")
    return Error("unsupported", type(body).__name__), None


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert torch.equal(bits(got), bits(want))
