"""Typed clients of the draft and target services: Python lists in, Python lists out.

They pack per-entry token lists into the flat payload tensors the messages describe and cut the
replies back into per-request results. The gateway, the tests and the benchmarks all use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
import torch

from specserve.shared.wire.logprobs import TokenLogprobs, cut
from specserve.shared.wire.messages import (
    VERIFY_MASKED,
    VERIFY_ROOT_PENDING,
    ErrorInfo,
    Forward,
    ForwardReply,
    Health,
    HealthReply,
    Offload,
    PrefillEntry,
    Release,
    ReleaseReply,
    Reload,
    SamplingSpec,
    Speculate,
    SpeculateEntry,
    SpeculateReply,
    Stats,
    StatsReply,
    TransitionReply,
    VerifyColumns,
)
from specserve.shared.wire.rpc import RpcClient
from specserve.shared.wire.transport import split_flat


def _flat(lists: list[list[int]]) -> torch.Tensor:
    # numpy packs a list of ints several times faster than torch.tensor; the tensor shares its buffer
    return torch.from_numpy(np.array([t for toks in lists for t in toks], dtype=np.int32))


def _nonempty(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An empty tensor is not sent: the services read a missing one as no tokens (split_counts)."""
    return {name: t for name, t in tensors.items() if t.numel()}


def _cut(flat: torch.Tensor, counts: list[int]) -> list[list[Any]]:
    return split_flat(flat.tolist(), counts)


@dataclass(slots=True)
class SpeculateItem:
    rid: str
    step: int
    new_tokens: list[int]  # committed since this request's last speculate call (then the assumed ones)
    num_committed: int  # all committed tokens after them (the assumed ones excluded)
    depth: int
    width: int
    assumed: int = 0  # drafting ahead: the last `assumed` new tokens are a guess the draft forgets afterwards
    features: torch.Tensor | None = None  # target features [n, hidden] from position feature_start (EAGLE drafts)
    feature_start: int = 0


@dataclass(slots=True)
class Candidate:
    """A draft tree: node 0 is the root (the newest committed token)."""

    rid: str
    step: int
    tokens: list[int]
    parents: list[int]
    path_prob: list[float]
    depth: int
    error: ErrorInfo | None = None


@dataclass(slots=True)
class PrefillItem:
    rid: str
    step: int
    start: int
    tokens: list[int]
    last: bool
    sampling: SamplingSpec | None = None
    resume_token: int | None = None  # see PrefillEntry.resume_token
    mask: torch.Tensor | None = None  # structured output: int32 [1, ceil(V / 32)], the first token's allowed set


@dataclass(slots=True)
class VerifyItem:
    rid: str
    step: int
    num_committed: int
    tokens: list[int]  # root first
    parents: list[int]
    masks: torch.Tensor | None = None  # structured output: int32 [len(tokens), ceil(V / 32)], per node
    root_pending: bool = False  # VerifyEntry.root_pending: the target fills in the root (tokens[0] is ignored)
    guess: int = 0  # VerifyEntry.guess: a tree drafted on a guess of the step before it (see there)


@dataclass(slots=True)
class StepOutput:
    rid: str
    step: int
    tokens: list[int] = field(default_factory=list)  # accepted drafts + 1 target token, or the first token
    num_accepted: int = 0
    error: ErrorInfo | None = None
    features: torch.Tensor | None = None  # with forward(features=True): see StepResult.num_features
    prompt_logprobs: TokenLogprobs | None = None  # with SamplingSpec.prompt_logprobs: this chunk's prompt positions
    logprobs: TokenLogprobs | None = None  # with SamplingSpec.logprobs: one row per emitted token
    num_cached: int = 0  # a prefill chunk: its leading tokens the target took from its prefix cache


class _ServiceClient:
    def __init__(self, rpc: RpcClient):
        self.rpc = rpc

    @classmethod
    async def connect(cls, address: str) -> Self:
        return cls(await RpcClient.connect(address))

    async def health(self) -> HealthReply:
        reply, _ = await self.rpc.call(Health(), HealthReply)
        return reply

    async def stats(self) -> StatsReply:
        reply, _ = await self.rpc.call(Stats(), StatsReply)
        return reply

    async def release(self, rids: list[str]) -> ReleaseReply:
        reply, _ = await self.rpc.call(Release(list(rids)), ReleaseReply)
        return reply

    async def close(self) -> None:
        await self.rpc.close()


class DraftClient(_ServiceClient):
    async def speculate(self, items: list[SpeculateItem]) -> tuple[list[Candidate], SpeculateReply]:
        entries = [SpeculateEntry(i.rid, i.step, len(i.new_tokens), i.num_committed, i.depth, i.width,
                                  i.assumed, i.feature_start, 0 if i.features is None else len(i.features))
                   for i in items]
        tensors = {"tokens": _flat([i.new_tokens for i in items])}
        feats = [i.features for i in items if i.features is not None and len(i.features)]
        if feats:
            tensors["features"] = torch.cat(feats).float()
        reply, out = await self.rpc.call(Speculate(entries), SpeculateReply, _nonempty(tensors))
        counts = [t.num_nodes for t in reply.trees]
        tokens, parents, probs = (_cut(out[k], counts) for k in ("tokens", "parents", "path_prob"))
        return [Candidate(t.rid, t.step, tok, par, pp, t.depth, t.error)
                for t, tok, par, pp in zip(reply.trees, tokens, parents, probs)], reply

    async def offload(self) -> TransitionReply:
        reply, _ = await self.rpc.call(Offload(), TransitionReply)
        return reply

    async def reload(self) -> TransitionReply:
        reply, _ = await self.rpc.call(Reload(), TransitionReply)
        return reply


class TargetClient(_ServiceClient):
    async def forward(self, prefill: Sequence[PrefillItem] = (), verify: Sequence[VerifyItem] = (),
                      features: bool = False, release: Sequence[str] = ()) -> tuple[list[StepOutput], ForwardReply]:
        """features: also return the target's features (StepResult.num_features) in StepOutput.features;
        release: requests the target frees before the pass (Forward.release)."""
        msg = Forward([PrefillEntry(p.rid, p.step, p.start, len(p.tokens), p.last, p.sampling, p.resume_token,
                                    p.mask is not None)
                       for p in prefill],
                      VerifyColumns.build([v.rid for v in verify], [v.step for v in verify],
                                          [v.num_committed for v in verify], [len(v.tokens) for v in verify],
                                          [VERIFY_MASKED * (v.masks is not None) + VERIFY_ROOT_PENDING * v.root_pending
                                           for v in verify], [v.guess for v in verify]), features, list(release))
        tensors = {"prefill_tokens": _flat([p.tokens for p in prefill]),
                   "tree_tokens": _flat([v.tokens for v in verify]),
                   "tree_parents": _flat([v.parents for v in verify])}
        masks = [m for m in [*(p.mask for p in prefill), *(v.masks for v in verify)] if m is not None]
        if masks:  # only requests with a grammar send rows: the others pay nothing
            tensors["token_masks"] = torch.cat(masks).to(torch.int32)
        reply, out = await self.rpc.call(msg, ForwardReply, _nonempty(tensors))
        results = reply.results
        steps, counts, accepted = (a.tolist() for a in results.arrays())
        tokens = _cut(out["tokens"], counts)
        extra, errors, n = results.extra, results.errors, len(results)
        rows: list[torch.Tensor | None] = [None] * n
        if "features" in out:
            rows = list(out["features"].split([extra[i].num_features if i in extra else 0 for i in range(n)]))
        scored: list[tuple[TokenLogprobs | None, TokenLogprobs | None]]
        scored = cut(out, results.rows()) if "logprobs" in out else [(None, None)] * n
        return [StepOutput(rid, step, toks, a, errors.get(i) if errors else None,
                           f if f is not None and len(f) else None, lp[0], lp[1],
                           extra[i].num_cached if i in extra else 0)
                for i, (rid, step, toks, a, f, lp) in enumerate(zip(results.rids, steps, tokens, accepted, rows,
                                                                    scored))], reply
