"""The messages between the HTTP side and the engine, and the engine's own state of a request.

In: a `Submission` (what the HTTP side asks for). Out, on the queue `submit` returns: `Admitted` once
(unless refused first), `Tokens` per step, `Finished` once, with the request's `specserve` report. The
engine keeps its state in a `GenRequest`, which the HTTP side never sees.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.runtime.block_hash import ROOT, chain
from specserve.shared.spec.feature_log import FeatureLog
from specserve.shared.wire.logprobs import TokenLogprobs
from specserve.shared.wire.messages import SamplingSpec

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

    from specserve.gateway.engine.constrain import Constraint
    from specserve.gateway.engine.grammar import RequestGrammar
    from specserve.gateway.perf.record import DraftStep, RequestStep
    from specserve.gateway.sched.policy.base import CandidateTree


@dataclass(slots=True)
class SentAhead:
    """A request's decode entry in a pass sent ahead (--async-scheduling, engine/ahead.py), until that pass is
    committed."""

    step: int
    base: int  # its num_committed: the request's committed tokens before it, at least (VerifyEntry)
    guess: int  # VerifyEntry.guess (0: not drafted on a guess)
    pending: bool  # its root is the token the pass before it emits (VerifyEntry.root_pending)
    tokens: list[int]  # as sent, root first (a placeholder where pending)
    parents: list[int]
    path: list[int] | None  # the draft tokens it verifies, once known (where pending: when the pass before is in)
    entry: RequestStep | None = None  # its record's entry
    counts: DraftStep | None = None  # where drafted on a guess: its record's, which counts the guesses and hits


@dataclass(slots=True)
class Tokens:
    """New output tokens of one step (already cut at EOS, max_tokens and the context length); for a request
    that asked for logprobs, theirs, and in its first `Tokens` the prompt's (`echo`; it may have no tokens)."""

    tokens: list[int]
    logprobs: TokenLogprobs | None = None  # one row per token
    prompt_logprobs: TokenLogprobs | None = None  # one row per prompt token but the first


@dataclass(slots=True)
class Admitted:
    """The request left the waiting queue and is bound to a target replica."""

    replica: int


@dataclass(slots=True)
class Finished:
    reason: str  # "stop", "length", "abort", "error" or "rejected" (refused before admission)
    error: str | None = None  # what went wrong, when reason is "error" or "rejected"
    retry_after_s: float | None = None  # "rejected": when to come back
    report: dict | None = None  # the response's `specserve` object (GenRequest.report), as the engine ends it


Event = Admitted | Tokens | Finished


@dataclass(frozen=True, slots=True)
class Submission:
    """A request as the HTTP side hands it to the engine: tokenized and checked."""

    rid: str
    prompt: list[int]
    sampling: SamplingSpec
    max_tokens: int  # output tokens allowed (already capped by the context length)
    slo: SloClass
    stop_ids: frozenset[int]  # token ids that end the output (EOS); not streamed as text
    best_effort_ok: bool = False  # may be served without an SLO when no replica can meet it
    trace: SpanContext | None = None  # the request span it was submitted under (a front end's), if any
    grammar: RequestGrammar | None = None  # structured output: the grammar every output token must follow
    # its handler reads the output once, at the end (a response not streamed, with no stop string and no
    # logprobs): the engine hands its tokens over with its Finished, not every iteration (as vLLM's FINAL_ONLY)
    final_only: bool = False


@dataclass(eq=False, slots=True)
class GenRequest:
    rid: str
    prompt: list[int]
    sampling: SamplingSpec
    max_tokens: int  # output tokens allowed (already capped by the context length)
    slo: SloClass
    stop_ids: frozenset[int]  # token ids that end the output (EOS); not streamed as text
    stop_kept: frozenset[int] = frozenset()  # the request's stop_token_ids: end the output, kept in it
    kv_blocks: int = 0  # target KV blocks reserved for it while admitted
    replica: int | None = None  # the target replica it is bound to once admitted
    arrival: float = field(default_factory=time.perf_counter)  # perf_counter seconds
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Tokens / Finished for the handler
    admitted_at: float | None = None
    prefilled: int = 0  # prompt tokens already in the target's KV
    cached: int = 0  # prompt tokens its replica's prefix cache is expected to hold (set at admission; see prefix.py)
    cached_tokens: int = 0  # prompt tokens its replica took from its prefix cache (what the target said)
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # perf_counter seconds, one per output token
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verify step
    verified: list[tuple[int, int]] = field(default_factory=list)  # (engine step, tree nodes sent incl. root)
    draft_unsent: list[int] = field(default_factory=list)  # committed tokens the draft has not seen
    draft_seen: bool = False  # the draft may hold state for it (it must be released there)
    draft_epoch: int = 0  # how many times its draft state was rebuilt (a reply to an older entry is stale)
    features: FeatureLog | None = None  # the target's features by position, for a draft that reads them
    features_sent: int = 0  # leading positions of `features` the draft holds
    next_tree: CandidateTree | None = None  # its next tree, drafted ahead during the last target pass (--overlap)
    out_of_blocks: int = 0  # iterations its replica refused it for lack of free KV blocks
    finish_reason: str | None = None
    resuming: bool = False  # preempted: its KV is being rebuilt from `context` before it decodes again
    readmitted: bool = False  # admitted once and waiting again (preempted, or its replica lost): never refused
    served_best_effort: bool = False  # admitted in the best-effort tier: no SLO applies to it
    best_effort_ok: bool = False  # may be served without an SLO when no replica can meet it (SLO-aware admission)
    trace: SpanContext | None = None  # its HTTP request's span, while tracing is on (iterations link to it)
    prompt_logprobs: TokenLogprobs | None = None  # with sampling.prompt_logprobs: the prompt's, until its first token
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its leading full blocks (prefix.py)
    grammar: Constraint | None = None  # structured output: its matcher, and its trees shaped by it (constrain.py)
    final_only: bool = False  # Submission.final_only: its tokens are handed over at its end, not as they come
    held: list[int] = field(default_factory=list)  # final_only: output tokens not handed over yet
    # --async-scheduling (engine/ahead.py): its entries in a pass whose outputs are not committed yet
    ahead_step: int = 0  # the step of its newest decode entry in flight (0: none)
    sent_ahead: SentAhead | None = None  # that entry
    chunk_step: int = 0  # the step of its newest prompt chunk in flight (0: none)
    chunk_end: int = 0  # where that chunk ends in its context
    void_step: int = 0  # outputs of steps up to this one are dropped (sent on a state that did not come true)

    @classmethod
    def of(cls, sub: Submission, events: asyncio.Queue | None = None) -> GenRequest:
        """The engine's state of a submitted request; its events go to `events` (a new queue if None)."""
        req = cls(sub.rid, list(sub.prompt), sub.sampling, sub.max_tokens, sub.slo, sub.stop_ids,
                  frozenset(sub.sampling.stop_token_ids) - sub.stop_ids, best_effort_ok=sub.best_effort_ok,
                  trace=sub.trace, grammar=sub.grammar.constraint() if sub.grammar is not None else None,
                  final_only=sub.final_only)
        if events is not None:
            req.events = events
        return req

    @property
    def committed(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def context(self) -> list[int]:
        """The tokens its target KV is built from by prefill: the prompt, or after a preemption the
        prompt and every output token but the newest (which is the next tree's root)."""
        return self.prompt + self.output[:-1] if self.resuming else self.prompt

    def keys(self, block_size: int, tokens: int) -> list[bytes]:
        """The prefix-cache keys of the full blocks among its first `tokens` tokens of prompt + output (the
        services' keys: shared/runtime/block_hash.py), hashed once and kept."""
        keys, want = self.block_keys, min(tokens, self.committed) // block_size
        if len(keys) < want:
            seq = (self.prompt + self.output)[len(keys) * block_size: want * block_size]
            keys += chain(seq, block_size, keys[-1] if keys else ROOT)
        return keys[:want]

    @property
    def prefill_sampling(self) -> SamplingSpec:
        """The sampling its first prompt chunk carries: without prompt logprobs when it rebuilds its KV after a
        preemption (they went out with its first token)."""
        if self.resuming and self.sampling.prompt_logprobs:
            return msgspec.structs.replace(self.sampling, prompt_logprobs=False)
        return self.sampling

    @property
    def decoding(self) -> bool:
        return bool(self.output) and not self.resuming and self.finish_reason is None

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output)

    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than 2 tokens)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def report(self) -> dict:
        """The `specserve` extension object of a response: SLO (and whether both its targets were met),
        time to first token and per output token after it, prompt tokens served from the prefix cache, and
        speculation per step."""
        tpot, ttft = self.tpot_s(), self.ttft_s()
        return {"slo": {"tier": self.slo.name, "tpot_ms": self.slo.tpot_ms, "ttft_ms": self.slo.ttft_ms},
                "replica": self.replica,
                "cached_tokens": self.cached_tokens,
                "best_effort": self.served_best_effort,
                "ttft_ms": None if ttft is None else round(ttft * 1e3, 3),
                "tpot_ms": None if tpot is None else round(tpot * 1e3, 3),
                "slo_met": None if ttft is None else self.slo_met(),
                "steps": [[step, nodes, acc] for (step, nodes), acc in zip(self.verified, self.accepted)]}

    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first output token (None before it)."""
        return self.token_times[0] - self.arrival if self.token_times else None

    def slo_met(self) -> bool:
        """Both SLOs met: the first token within the TTFT target and the mean time per later token within
        the TPOT target (fewer than 2 tokens: no TPOT to miss)."""
        ttft, tpot = self.ttft_s(), self.tpot_s()
        return (ttft is not None and ttft * 1e3 <= self.slo.ttft_ms
                and (tpot is None or tpot * 1e3 <= self.slo.tpot_ms))
