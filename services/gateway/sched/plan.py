"""What the scheduler sees and decides: a snapshot of the gateway's state in, one IterationPlan out.

These are plain data, shared by the scheduler (scheduler.py), the policies (policy/) and the
engine. Nothing here does I/O or reads a clock: every time is carried in the snapshot.

- `SchedulerView`: the snapshot. Waiting requests, running requests (still prefilling or decoding),
  the target replicas (up, KV ledger, cost model), the draft's state, the limits, and the
  scheduler's own FIFO `Proposal` for admission and prefill chunks. Each replica plans its own
  iterations (engine/loop.py): `replica` names it, and the plan's shapes, chunks and preemptions
  that are carried out are that replica's; admissions go to any replica.
- `Decision`: what a policy answers through its one decision hook, `Policy.decide(view)`.
- `IterationPlan`: the decision after the scheduler enforced the hard limits; every deviation from
  the decision carries a reason.
- `BatchView`: one replica's decoding requests as the speculation shape and node selection see
  them (budget B is per target pass, so per replica).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from specserve.gateway.perf.cost import PassCost


class Residency(enum.Enum):
    """The draft model's placement for the next iteration (Nightjar's offload)."""

    KEEP = "keep"  # leave it where it is
    OFFLOAD = "offload"  # weights to host memory, KV pool freed: no speculation until reloaded
    RELOAD = "reload"  # weights back on the device; requests catch up their draft KV lazily


@dataclass(slots=True, frozen=True)
class Shape:
    depth: int  # beam steps d (0 = no draft tokens)
    width: int  # beam width w


NO_DRAFT = Shape(0, 1)
# The share of a prompt's time to its TTFT deadline that the plans keep back: its last pass planned to end by
# the deadline less this, for what comes after that pass (the first token's commit and its way to the client)
TTFT_RESERVE = 0.02


def last_pass_end_ms(left_ms: float) -> float:
    """The latest a prompt's last pass may end, in ms from now, when its TTFT deadline is `left_ms` away: the
    deadline less `TTFT_RESERVE` of the time left."""
    return left_ms * (1.0 - TTFT_RESERVE)


@dataclass(slots=True)
class RequestView:
    """What a policy sees of one decoding request."""

    rid: str
    tier: str  # SLO class name
    tpot_ms: float  # TPOT SLO, ms per output token after the first
    ttft_ms: float  # TTFT SLO, ms
    decoded: int  # o_i: output tokens after the first
    decode_elapsed_ms: float  # l_i: ms since the first output token
    remaining: int  # output tokens still allowed (max_tokens and context); >= 1
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens of each past verify step
    replica: int = 0  # the target replica it is bound to
    draft_lag: int = 0  # committed tokens the draft has not seen (its catch-up if it speculates now)
    kv_blocks: int = 0  # target KV blocks it has reserved

    def required(self, t_spec_ms: float) -> float:
        """AdaServe's A(r): tokens this step must yield to stay on the TPOT SLO in expectation."""
        return (self.decode_elapsed_ms + t_spec_ms) / self.tpot_ms - self.decoded

    def pace_ms(self) -> float:
        """The ms per token it may take over its remaining tokens and still meet its TPOT SLO (a TPOT
        is a mean over the request's tokens: one ahead of it may go slower from now on)."""
        return (self.tpot_ms * (self.decoded + self.remaining) - self.decode_elapsed_ms) / max(self.remaining, 1)


@dataclass(slots=True)
class PrefillView:
    """An admitted request whose prompt is not fully in its replica's KV yet."""

    rid: str
    replica: int
    prompt_tokens: int
    prefilled: int  # prompt tokens already in the target's KV (or expected in its prefix cache before its first chunk)
    tier: str
    tpot_ms: float  # TPOT SLO, ms (it decodes at it once its prompt is in)
    ttft_ms: float  # TTFT SLO, ms
    waited_ms: float  # since arrival


@dataclass(slots=True)
class WaitingView:
    """A request not admitted yet."""

    rid: str
    prompt_tokens: int
    max_tokens: int  # output tokens allowed
    kv_blocks: int  # target KV blocks it reserves once admitted
    tier: str
    tpot_ms: float  # TPOT SLO, ms
    ttft_ms: float  # TTFT SLO, ms
    waited_ms: float  # since arrival
    best_effort: bool = False  # it may be served without an SLO when no replica can meet it (service_tier flex)
    cached: tuple[int, ...] = ()  # per replica index: its prompt tokens that replica's prefix cache holds (expected)

    def uncached(self, replica: int | None) -> int:
        """Its prompt tokens that replica would compute: what its prefix cache holds is not priced."""
        held = self.cached[replica] if replica is not None and 0 <= replica < len(self.cached) else 0
        return self.prompt_tokens - held


@dataclass(slots=True)
class ReplicaView:
    index: int
    up: bool  # reachable and taking requests (none is placed on a replica that is down or draining)
    total_blocks: int  # its KV pool, blocks
    reserved_blocks: int  # blocks reserved by the requests bound to it
    running: int  # requests bound to it
    cost: PassCost  # its budget B, profiled curve and live estimates
    held_blocks: int = 0  # KV blocks its requests hold now (the target's last word): the context its passes attend to
    block_size: int = 16  # tokens per KV block

    def blocks_for(self, tokens: int) -> int:
        """KV blocks that `tokens` tokens fill on it."""
        return math.ceil(max(tokens, 0) / self.block_size)

    @property
    def free_blocks(self) -> int:
        """Blocks not reserved by any admitted request."""
        return self.total_blocks - self.reserved_blocks


@dataclass(slots=True)
class DraftView:
    up: bool  # connected
    offloaded: bool  # weights in host memory: it returns root-only trees

    @property
    def usable(self) -> bool:
        return self.up and not self.offloaded


@dataclass(slots=True)
class Limits:
    max_running: int  # most requests bound to one replica
    max_prefill_tokens: int  # most prompt tokens in one replica's pass (chunked prefill)
    max_depth: int  # the deepest beam the draft accepts
    max_width: int  # the widest beam the draft accepts


@dataclass(slots=True)
class Admit:
    rid: str
    replica: int | None = None  # None: the router picks


@dataclass(slots=True)
class Reject:
    reason: str
    retry_after_s: float | None = None  # when to come back (the HTTP answer's Retry-After)


@dataclass(slots=True)
class Proposal:
    """The scheduler's default: FIFO admission through the router, FIFO prompt chunks per replica."""

    admit: list[Admit]  # replicas chosen
    defer: dict[str, str]  # rid -> reason
    chunks: dict[str, int]  # rid -> prompt tokens this iteration (running and newly admitted)
    prefill_tokens: list[int]  # per replica: the sum of its chunks
    reject: dict[str, Reject] = field(default_factory=dict)  # rid -> refused at once (SLO-aware admission)
    preempt: list[str] = field(default_factory=list)  # best-effort rids whose KV goes to SLO arrivals


@dataclass(slots=True)
class SchedulerView:
    waiting: list[WaitingView]  # arrival order
    prefilling: list[PrefillView]  # admission order
    decoding: list[RequestView]  # admission order
    replicas: list[ReplicaView]
    draft: DraftView
    limits: Limits
    proposal: Proposal = field(default_factory=lambda: Proposal([], {}, {}, []))
    replica: int | None = None  # the replica whose iteration this plans (None: every replica's)
    live: AbstractSet[str] | None = None  # every admitted request's id, all replicas (None: those in this view)
    _groups: list[list[RequestView]] | None = field(default=None, repr=False)

    @property
    def live_rids(self) -> AbstractSet[str]:
        """The ids of the requests still admitted, on every replica: per-request state of any other id
        may be forgotten (a view that plans one replica may hold only that replica's requests)."""
        if self.live is not None:
            return self.live
        return {r.rid for r in self.decoding} | {p.rid for p in self.prefilling}

    def stepping(self, replica: int) -> bool:
        """Whether this plan's shapes, chunks and preemptions on `replica` are carried out."""
        return self.replica is None or replica == self.replica

    def batches(self, prefill_tokens: list[int]) -> list[BatchView]:
        """The decoding requests grouped by replica, with each replica's co-scheduled prompt tokens; when
        the view plans one replica, the others' batches are empty (their own iterations shape them)."""
        if self._groups is None:
            self._groups = [[] for _ in self.replicas]
            for r in self.decoding:
                if self.stepping(r.replica):
                    self._groups[r.replica].append(r)
        chunk = [prefill_tokens[i] if i < len(prefill_tokens) else 0 for i in range(len(self.replicas))]
        prompts: list[list[tuple[int, float]]] = [[] for _ in self.replicas]
        for p in self.prefilling:
            prompts[p.replica].append((p.prompt_tokens - p.prefilled, p.ttft_ms - p.waited_ms))
        return [BatchView(g, chunk[i], len(self.waiting), self.draft.usable, i,
                          rep.held_blocks + rep.blocks_for(chunk[i]), len(prompts[i]),
                          tuple(sorted(prompts[i], key=lambda p: p[1])))
                for i, (g, rep) in enumerate(zip(self._groups, self.replicas, strict=True))]


@dataclass(slots=True)
class BatchView:
    requests: list[RequestView]  # one replica's decoding requests, in admission order
    prefill_tokens: int = 0  # prompt tokens co-scheduled in this replica's target pass
    waiting: int = 0  # requests not yet admitted (all replicas)
    draft_available: bool = True  # False while the draft is down or offloaded (shapes are then ignored)
    replica: int = 0
    kv_blocks: int = 0  # KV blocks the pass attends to: what the replica's requests hold, and its prompt chunks
    prefilling: int = 0  # this replica's admitted requests whose prompt is not all in its KV yet
    # those requests, earliest TTFT deadline first (the order SLO admission gives them chunks): (prompt tokens
    # still to compute, this pass's chunk included; ms left before their TTFT SLO ends)
    prompts: tuple[tuple[int, float], ...] = ()

    def tree_budget(self, model: PassCost) -> int:
        """The budget left for trees, roots included: B minus the co-scheduled prefill tokens,
        never below one root per request."""
        return max(len(self.requests), model.budget_tokens - self.prefill_tokens)


@dataclass(slots=True)
class Decision:
    """A policy's answer for one iteration. The scheduler enforces the hard limits on it."""

    admit: list[Admit]  # in the order to try; the rest of the waiting queue stays waiting
    defer: dict[str, str] = field(default_factory=dict)  # rid -> why it waits
    reject: dict[str, Reject] = field(default_factory=dict)  # rid -> why it is refused (it ends, 503)
    chunks: dict[str, int] | None = None  # rid -> prompt tokens this iteration; None: the FIFO proposal
    shapes: dict[str, Shape] = field(default_factory=dict)  # decoding rid -> (d, w); missing: d = 0
    residency: Residency = Residency.KEEP
    strict_order: bool = True  # stop admitting at the first request that does not fit (FIFO fairness)


@dataclass(slots=True)
class IterationPlan:
    step: int  # the engine's iteration counter
    admitted: list[Admit]  # every one with its replica
    deferred: dict[str, str]  # rid -> reason
    rejected: dict[str, Reject]
    chunks: dict[str, int]  # rid -> prompt tokens in this iteration's pass (> 0 only)
    shapes: dict[str, Shape]  # every decoding request; d = 0 means no draft tokens
    batches: list[BatchView]  # per replica, for node selection
    residency: Residency
    draft_sync: list[str] = field(default_factory=list)  # d = 0 requests whose new tokens go to the draft anyway
    preempt: list[str] = field(default_factory=list)  # decoding requests to preempt (recompute) before admitting

    @property
    def speculating(self) -> list[str]:
        return [rid for rid, s in self.shapes.items() if s.depth > 0]
