"""One replica's PB* for the DP: its cost model's time2bs, the tiers' measured cost and gain, memoised per call.

Our engine puts every decoding request in every target pass (continuous batching), so in the
digest's terms every decoder is due in every batch, whatever its TPOT: a looser tier does not free
budget by skipping batches, it only lengthens the batch it may ride. Plain decoding (every tier
costs and yields one token per pass) is therefore the closed form of Algorithm 2 with every TPOT_r
= t0, i.e. B·(time2bs(t0) − n); with speculation it is the §7 form with the measured per-tier cost
and gain; both are `BatchShape`s (budget.py), which also plan cycles of passes of the decoders alone
that bank time for one long prompt pass where those feed prompts faster. The batch length with
nothing decoding is `idle_ms`, and no batch is longer than `longest_ms`, the planned time of the largest
pass the engine runs (its prefill cap beside its decoders): a loose TPOT (say 100 s) does not make one
pass of 100 s, the engine runs many short ones, so a prompt's TTFT is met within a fraction of that TPOT.

`best_plan` runs the DP at each operating point; `prefill_chunks` hands each replica's prefill room to
its prompts in deadline order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from specserve.gateway.perf.cost import PassCost, most_tokens
from specserve.gateway.sched.admission.budget import BatchShape, TierLoad, batch_shape
from specserve.gateway.sched.admission.dp import Budget, Node, plan
from specserve.gateway.sched.plan import SchedulerView, last_pass_end_ms

MIN_CHUNK_TOKENS = 16  # a prefilling prompt always advances by at least this much


class Prices:
    """One planning call's prices, shared by all its replica budgets (several price the same passes: two
    operating points, with and without the margin, at the KV of each arrival): a pass's planned ms by its
    tokens (`PassCost.pricer`) and the most tokens a pass of a given length holds, per cost model, draft
    steps, KV blocks and margin. Valid for one call: no cost model is refitted within it."""

    def __init__(self) -> None:
        self._pricers: dict[tuple[int, int, int, bool], Callable[[int], float]] = {}
        self._caps: dict[tuple[int, int, int, bool, float], int] = {}

    def pricer(self, cost: PassCost, steps: int, kv: int, margin: bool) -> Callable[[int], float]:
        key = (id(cost), steps, kv, margin)
        p = self._pricers.get(key)
        if p is None:
            p = self._pricers[key] = cost.pricer(steps, kv, margin)
        return p

    def cap(self, cost: PassCost, steps: int, kv: int, margin: bool, length_ms: float) -> int:
        """`most_tokens` of that pricer within `length_ms`."""
        key = (id(cost), steps, kv, margin, length_ms)
        c = self._caps.get(key)
        if c is None:
            c = self._caps[key] = most_tokens(self.pricer(cost, steps, kv, margin), length_ms)
        return c


class ReplicaBudget:
    def __init__(self, cost: PassCost, tiers: Sequence[TierLoad], idle_ms: float, spec_steps: int = 0,
                 kv_blocks: int = 0, longest_ms: float = math.inf, margin: bool = True,
                 prices: Prices | None = None):
        self.cost = cost
        self.prices = prices or Prices()  # the planning call's, shared with its other budgets
        self.margin = margin  # passes priced with the cost model's margin (False: at their expected time)
        self.longest_ms = longest_ms
        self.kv_blocks = kv_blocks  # KV blocks the replica's requests will hold: the context its passes attend to
        self.tiers = list(tiers)
        self.idle_ms = idle_ms  # batch length when nothing decodes
        self.spec_steps = spec_steps
        self._shapes: dict[tuple[int, ...], BatchShape] = {}
        self._windows: dict[tuple[float, tuple[int, ...]], int | None] = {}  # the DP asks the same ones often

    def attending(self, kv_blocks: int) -> ReplicaBudget:
        """The same replica and tiers with its passes attending to `kv_blocks` (fresh shapes and windows; the
        call's prices shared)."""
        return ReplicaBudget(self.cost, self.tiers, self.idle_ms, self.spec_steps, kv_blocks, self.longest_ms,
                             self.margin, self.prices)

    def cap(self, length_ms: float, spec_steps: int | None = None) -> int:
        """Tokens one pass of `length_ms` holds, with the draft call of `spec_steps` (default: the
        replica's moving average; 0 when nothing decodes, so nothing drafts)."""
        steps = self.spec_steps if spec_steps is None else spec_steps
        return self.prices.cap(self.cost, steps, self.kv_blocks, self.margin, length_ms)

    def _pricer(self, steps: int) -> Callable[[int], float]:
        """A pass's planned ms by its tokens, with the draft call of `steps`."""
        return self.prices.pricer(self.cost, steps, self.kv_blocks, self.margin)

    def _steps(self, decoders: tuple[int, ...]) -> int:
        """The draft call's depth in a pass with these decoders: none when nothing decodes."""
        return self.spec_steps if any(decoders) else 0

    def shape(self, decoders: tuple[int, ...]) -> BatchShape:
        s = self._shapes.get(decoders)
        if s is None:
            steps = self._steps(decoders)
            s = self._shapes[decoders] = batch_shape(
                decoders, self.tiers, lambda ms: self.cap(ms, steps), self.idle_ms, self.longest_ms,
                self._pricer(steps))
        return s

    def window(self, ms: float, decoders: tuple[int, ...]) -> int | None:
        key = (ms, decoders)
        if key not in self._windows:
            self._windows[key] = self._window(ms, decoders)
        return self._windows[key]

    def _window(self, ms: float, decoders: tuple[int, ...]) -> int | None:
        if ms <= 0:
            return 0
        s = self.shape(decoders)
        return s.budget(ms) if s.feasible else None

    def sustainable(self, decoders: tuple[int, ...]) -> bool:
        return self.shape(decoders).feasible

    def as_budget(self) -> Budget:
        return Budget(self.window, self.sustainable)


def best_plan(nodes: list[Node], base: list[int], blocks: int, points: list[ReplicaBudget]) -> set[str]:
    """The DP's admissions at the first operating point that admits the most (ties: the earlier)."""
    best: set[str] = set()
    for i, b in enumerate(points):
        took = set(plan(nodes, base, blocks, b.as_budget()).admitted)
        if i == 0 or len(took) > len(best):
            best = took
        if len(best) == sum(not n.forced for n in nodes):
            break
    return best


def prefill_chunks(view: SchedulerView, budgets: dict[int, list[ReplicaBudget]], base: dict[int, list[int]],
                   held: dict[int, list[Node]], offered: AbstractSet[str], due_ms: dict[int, float],
                   best_effort_tier: int | None = None) -> tuple[dict[str, int], list[int]]:
    """Each replica's prefill room this iteration, handed to its SLO prompts in prefill-deadline order,
    then to the best-effort ones. The room comes from the operating point whose batches feed its prompts
    fastest: in batches of T, time2bs(T) minus its decoders' tokens (at least `MIN_CHUNK_TOKENS`); in
    cycles, none in a pass of the decoders alone and the long pass's once its decoders have banked it;
    and for SLO prompts whatever the decoders have banked beyond that (`due_ms`: until the first SLO
    decoder's next token is due). It is raised to what keeps every SLO prompt not yet late within its
    deadline less its reserve (`last_pass_end_ms`; per batch, or per long pass of a cycle) and capped at the
    engine's chunk. Best-effort prompts never get more than the plan's room: nothing was promised them."""
    chunks: dict[str, int] = {}
    per_replica = [0] * len(view.replicas)
    left = {p.rid: p.prompt_tokens - p.prefilled for p in view.prefilling}
    # an offered request admitted in this plan is a held node of its replica, priced at what it computes there
    left.update({n.rid: n.prompt for nodes in held.values() for n in nodes if n.rid in offered})
    for replica, points in budgets.items():
        decoders = tuple(base[replica])
        point = max((b for b in points if b.shape(decoders).feasible), key=lambda b: b.shape(decoders).rate,
                    default=points[0])
        shape = point.shape(decoders)
        banked = point.cap(min(due_ms.get(replica, math.inf), point.longest_ms)) - shape.decode
        if shape.cycle:
            long_pass = banked >= shape.long_prefill
            planned, period = (shape.long_prefill if long_pass else 0), (shape.cycle + 1) * shape.length_ms
        else:
            long_pass = True
            planned, period = max(shape.prefill_per_batch, MIN_CHUNK_TOKENS), shape.length_ms
        room = max(planned, banked) if long_pass else 0  # a pass of the decoders alone banks for the long one
        by_deadline = sorted(held[replica], key=lambda x: (x.tier == best_effort_tier, x.deadline_ms))
        due = 0
        for n in by_deadline:
            if n.tier == best_effort_tier:
                break
            # every SLO prompt not yet late, with those due before it, is in by its deadline at this room
            due += left.get(n.rid, 0)
            periods = math.floor(last_pass_end_ms(n.deadline_ms) / period)
            if n.deadline_ms > 0 and (long_pass or periods == 0):
                room = max(room, math.ceil(due / max(1, periods)))
        room = min(room, view.limits.max_prefill_tokens)
        for n in by_deadline:
            if n.tier == best_effort_tier:  # the plan's room, not the decoders' bank: future SLO prompts' share
                room = min(room, max(0, planned - per_replica[replica]))
            take = min(left.get(n.rid, 0), room)
            if take > 0:
                chunks[n.rid] = take
                room -= take
                per_replica[replica] += take
    return chunks, per_replica


__all__ = ["MIN_CHUNK_TOKENS", "Prices", "ReplicaBudget", "best_plan", "prefill_chunks"]
