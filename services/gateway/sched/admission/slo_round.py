"""One iteration of SLO admission (slo.py): the plan's state and its steps, for every replica at once.

`SloRound` is made anew each iteration from the scheduler's view and the admission's state across
iterations (`AdmissionState`: the tiers requests were admitted in, the best-effort set, the measured
speculation); its steps offer the new requests to the replicas' planners (dp.py over budget_model.py),
serve or refuse the declined, decide the queue behind them, and return the proposal. No I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.admission.budget import TierLoad
from specserve.gateway.sched.admission.budget_model import Prices, ReplicaBudget, best_plan, prefill_chunks
from specserve.gateway.sched.admission.dp import Node
from specserve.gateway.sched.plan import Admit, Proposal, Reject, ReplicaView, SchedulerView, WaitingView

BEST_EFFORT_TPOT_MS = 1e6  # best effort has no TPOT: it never sets the batch length, yet costs its tokens
BEST_EFFORT_DEADLINE_MS = 3.6e6  # no TTFT bound: an hour stands for "whenever"
LOOKAHEAD = 32  # requests beyond the offer decided each plan, greedily (a one-node DP each, 0.1-0.5 ms)


@dataclass(slots=True)
class AdmissionCounts:
    """What the last plan did, per tier name (the engine turns it into metrics)."""

    declined: dict[str, int] = field(default_factory=dict)  # a replica's planner said no
    best_effort: dict[str, int] = field(default_factory=dict)  # admitted in the best-effort tier
    refused: dict[str, int] = field(default_factory=dict)  # 503


class AdmissionState(Protocol):
    """What a round reads and updates of the admission's state across iterations (slo.SloAdmission)."""

    tier_of: dict[str, float]  # rid -> the TPOT it was admitted with, ms
    best_effort: set[str]  # rids admitted in the best-effort tier
    spec_steps: float  # moving average of the deepest beam per iteration
    max_new: int  # new requests offered per iteration
    memory_buckets: int
    route_all: bool  # offer a declined request to every replica
    last: AdmissionCounts
    rotation: int  # this plan's first replica, rotating

    def load(self, tpot: float, prior: bool, pace: float) -> TierLoad: ...

    def alone(self, w: WaitingView, up: list[ReplicaView], chunk: int) -> bool: ...


class SloRound:
    """One iteration's plan: the DP's tiers, each replica's operating points, forced nodes, free blocks and
    slots, and what the plan has decided so far. Its steps, in order: `offer_new` (the first `max_new`
    waiting requests, each to its router's pick, then to the others), `serve_declined` (best effort
    where a replica can still start a declined one in time, else a refusal), `decide_queue` (the
    `LOOKAHEAD` behind them, greedily) and `proposal`."""

    def __init__(self, adm: AdmissionState, view: SchedulerView, best_effort_ok: set[str],
                 first: Mapping[str, int] | None):
        self.adm, self.view, self.best_effort_ok = adm, view, best_effort_ok
        self._attend_memo: dict[tuple[ReplicaBudget, int], ReplicaBudget] = {}
        self.prices = Prices()  # every budget of this plan prices its passes here
        self._tiers()
        self._replicas()
        self._routing(first)
        self.preempt: list[str] = []
        self.admit: list[Admit] = []
        self.defer = {w.rid: "waits its turn: the planner takes a few new requests per iteration"
                      for w in view.waiting[adm.max_new:]}
        self.reject: dict[str, Reject] = {}
        self.ahead: list[WaitingView] = []  # admitted from the queue behind the offer
        self.retry_s = retry_after(view)

    # ---- the plan's state ------------------------------------------------------------------------
    def _tiers(self) -> None:
        """The DP's tiers, keyed (pace, TPOT SLO): a tier's decoders at the pace they may all keep
        (`paces`), every request that starts now (offered, prefilling) at its SLO."""
        view, adm = self.view, self.adm
        self.tpot_of = {r.rid: adm.tier_of.setdefault(r.rid, r.tpot_ms) for r in view.decoding}
        self.tpot_of.update({p.rid: adm.tier_of.get(p.rid, p.tpot_ms) for p in view.prefilling})
        self.slos = set(self.tpot_of.values()) | {w.tpot_ms for w in view.waiting} | {BEST_EFFORT_TPOT_MS}
        pace = paces(view, self.tpot_of)
        self.key_of = {r.rid: (pace.get(self.tpot_of[r.rid], self.tpot_of[r.rid]), self.tpot_of[r.rid])
                       for r in view.decoding}
        self.tiers = sorted({(t, t) for t in self.slos} | set(self.key_of.values()))
        self.index = {k: i for i, k in enumerate(self.tiers)}

    def _replicas(self) -> None:
        """Per replica up: the KV its passes attend to, its decoders per tier, its operating points, its
        forced nodes (prompts admitted before, and those admitted in this plan), free blocks and slots."""
        view, adm = self.view, self.adm
        self.up = [rep for rep in view.replicas if rep.up]
        self.rep_of = {rep.index: rep for rep in self.up}
        # the KV its passes attend to while the prompts admitted now prefill: what its requests hold, and
        # the prompts still to come in (output tokens grow it slowly; their reservation is not attended to)
        self.attend = {rep.index: rep.held_blocks + sum(rep.blocks_for(p.prompt_tokens - p.prefilled)
                                                        for p in view.prefilling if p.replica == rep.index)
                       for rep in self.up}
        self.steps = round(adm.spec_steps)
        # the tiers whose batches cannot hold two tokens on some replica (time2bs(t) < 2, asked directly)
        needs = {t for t in self.slos if any(not (rep.cost.fits(1, t, self.steps, self.attend[rep.index])
                                                  and rep.cost.fits(2, t, self.steps, self.attend[rep.index]))
                                             for rep in self.up)}
        measuring = set(self.tpot_of.values())  # tiers with requests running now: what they get is measured
        self.offered = view.waiting[:adm.max_new]
        self.loads = [adm.load(t, t in needs and t not in measuring, pace) for pace, t in self.tiers]
        self.plain = [TierLoad(t.tpot_ms, paced=t.paced) for t in self.loads]
        self.base = {rep.index: [0] * len(self.tiers) for rep in self.up}
        for r in view.decoding:
            if r.replica in self.base:
                self.base[r.replica][self.index[self.key_of[r.rid]]] += 1
        self.budgets = self.points(True)
        self.held = {rep.index: [Node(p.rid, self.at_slo(self.tpot_of[p.rid]), p.prompt_tokens - p.prefilled,
                                      p.ttft_ms - p.waited_ms, 0, True)
                                 for p in view.prefilling if p.replica == rep.index] for rep in self.up}
        self.free = {rep.index: rep.free_blocks for rep in self.up}
        self.slots = {rep.index: max(0, view.limits.max_running - rep.running) for rep in self.up}
        self.baseline = {rep.index: rep.cost.baseline_iteration_ms for rep in self.up}  # the profile's, never refitted
        self.best_effort_on = {rep.index: [r for r in view.decoding
                                           if r.replica == rep.index and r.rid in adm.best_effort]
                               for rep in self.up}

    def _routing(self, first: Mapping[str, int] | None) -> None:
        """The replicas in this plan's rotating order, and each offered request's own replica."""
        self.order = _rotated([rep.index for rep in self.up], self.adm.rotation)
        if self.order:
            self.adm.rotation += 1
        self.home = {w.rid: first[w.rid] if first and first.get(w.rid) in self.order else self.order[0]
                     for w in self.offered} if self.order else {}

    def points(self, margin: bool) -> dict[int, list[ReplicaBudget]]:
        """Each replica's two operating points (measured, plain), priced with the cost model's margin or not."""
        return {rep.index: [replica_budget(rep.cost, ls, st, sum(self.base[rep.index]), self.attend[rep.index],
                                           self.view.limits.max_prefill_tokens, first, margin, self.prices)
                            for ls, st, first in ((self.loads, self.steps, False), (self.plain, 0, True))]
                for rep in self.up}

    def at_slo(self, tpot: float) -> int:
        """The DP's tier of a request that starts now with this TPOT SLO."""
        return self.index[(tpot, tpot)]

    def deadline(self, w: WaitingView, best_effort: bool) -> float:
        """Its prefill deadline: none in the best-effort tier if it allows that, else its TTFT's."""
        return BEST_EFFORT_DEADLINE_MS if best_effort and w.rid in self.best_effort_ok else w.ttft_ms - w.waited_ms

    def nodes(self, replica: int, cands: list[WaitingView], best_effort: bool, slots: int, free: int,
              unit: int) -> list[Node]:
        """The DP's new nodes: the candidates that fit this replica's free slots and blocks, each priced at the
        prompt tokens it would compute there (what the replica's prefix cache holds is not)."""
        return [Node(w.rid, self.at_slo(BEST_EFFORT_TPOT_MS if best_effort else w.tpot_ms), w.uncached(replica),
                     self.deadline(w, best_effort), math.ceil(w.kv_blocks / unit))
                for w in cands[:slots] if w.kv_blocks <= free]

    # ---- one replica's decisions -------------------------------------------------------------------
    def plan_on(self, replica: int, cands: list[WaitingView], best_effort: bool,
                budgets: dict[int, list[ReplicaBudget]] | None = None) -> tuple[set[str], list[ReplicaBudget]]:
        """The DP's admissions among these candidates on this replica beside its forced nodes, and the
        operating points it planned at (`budgets`: with the cost model's margin by default, or without)."""
        unit = max(1, math.ceil(self.free[replica] / self.adm.memory_buckets))
        new = self.nodes(replica, cands, best_effort, self.slots[replica], self.free[replica], unit)
        # the passes attend to the KV held now plus an arrival's prompt: exact for one arrival (the
        # usual case); when several are admitted at once, the next plans see all their prompts
        attending = self.attend[replica] + max((self.rep_of[replica].blocks_for(w.prompt_tokens) for w in cands),
                                               default=0)
        at = [self._attending(b, attending) for b in (budgets or self.budgets)[replica]]
        return (best_plan(self.held[replica] + new, self.base[replica], self.free[replica] // unit, at) if new
                else set()), at

    def _attending(self, budget: ReplicaBudget, blocks: int) -> ReplicaBudget:
        """`budget.attending(blocks)`, one per pair in this plan: its memos serve every later ask."""
        key = (budget, blocks)
        if key not in self._attend_memo:
            self._attend_memo[key] = budget.attending(blocks)
        return self._attend_memo[key]

    def take(self, replica: int, w: WaitingView, best_effort: bool) -> None:
        """Admit the request on this replica in this plan (in the best-effort tier, or its own): a forced
        node from now on, its blocks and slot taken."""
        tpot = BEST_EFFORT_TPOT_MS if best_effort else w.tpot_ms
        self.admit.append(Admit(w.rid, replica))
        self.held[replica].append(Node(w.rid, self.at_slo(tpot), w.uncached(replica), self.deadline(w, best_effort),
                                       0, True))
        self.free[replica] -= w.kv_blocks
        self.slots[replica] -= 1
        self.attend[replica] += self.rep_of[replica].blocks_for(w.prompt_tokens)
        self.adm.tier_of[w.rid] = tpot
        if best_effort:
            self.adm.best_effort.add(w.rid)

    def refuse(self, w: WaitingView) -> None:
        count(self.adm.last.refused, w.tier)
        self.reject[w.rid] = Reject("no target replica can meet this request's SLO now", self.retry_s)

    def offer(self, replica: int, cands: list[WaitingView], best_effort: bool,
              budgets: dict[int, list[ReplicaBudget]] | None = None) -> list[WaitingView]:
        """Plan this replica with these candidates; returns the ones it declined."""
        if not cands:
            return cands
        took, at = self.plan_on(replica, cands, best_effort, budgets)
        if not took and not any(self.base[replica]) and not self.held[replica] and self.slots[replica] > 0:
            # work conserving: an idle replica is spare capacity whatever its refitted model says. A
            # bad refit kept one idle beside a waiting best-effort request for good, and another
            # refusing every lone critical request (with nothing running, the model never learns
            # otherwise); an SLO request is taken if the profile's decode iteration meets its TPOT
            # and its TTFT is not already lost
            first = next((w for w in cands if w.kv_blocks <= self.free[replica] and (best_effort or (
                w.tpot_ms >= self.baseline[replica] and w.waited_ms < w.ttft_ms))), None)
            took = {first.rid} if first is not None else took
        if not best_effort and self.best_effort_on[replica] and any(
                w.rid not in took and w.rid not in self.best_effort_ok for w in cands):
            took = self.preempt_for(replica, cands, took, at)
        for w in cands:
            if w.rid in took:
                self.take(replica, w, best_effort)
        return [w for w in cands if w.rid not in took]

    def preempt_for(self, replica: int, cands: list[WaitingView], took: set[str],
                    points: list[ReplicaBudget]) -> set[str]:
        """SLO arrivals come before best effort (digest §8): plan again as if the replica's k best-effort
        requests with the least output (the cheapest to recompute) gave their KV back, k = 1, 2, 4, ...;
        the first k that admits more of the candidates that may not run best effort is preempted. One
        that may (no SLO asked, `flex`, `slo.best_effort`) never evicts another: declined here, it is
        served best effort itself, and an eviction would only trade one recomputed request for another."""
        strict = {w.rid for w in cands if w.rid not in self.best_effort_ok}
        victims = sorted(self.best_effort_on[replica], key=lambda r: r.decoded)
        k = 1
        while True:
            k = min(k, len(victims))
            going = victims[:k]
            base = list(self.base[replica])
            for r in going:
                base[self.index[self.key_of[r.rid]]] -= 1
            free = self.free[replica] + sum(r.kv_blocks for r in going)
            unit = max(1, math.ceil(free / self.adm.memory_buckets))
            new = self.nodes(replica, cands, False, self.slots[replica] + k, free, unit)
            took2 = best_plan(self.held[replica] + new, base, free // unit, points)
            if len(took2 & strict) > len(took & strict):
                self.preempt.extend(r.rid for r in going)
                self.best_effort_on[replica] = victims[k:]
                self.base[replica], self.free[replica] = base, free
                self.slots[replica] += k
                return took2
            if k == len(victims):
                return took
            k *= 2

    def route(self, cands: list[WaitingView], best_effort: bool,
              budgets: dict[int, list[ReplicaBudget]] | None = None) -> list[WaitingView]:
        """Each candidate asks its own replica first (the router's pick); with `route_all`, those it
        declines ask every other replica in turn. Returns the declined, in arrival order."""
        took: set[str] = set()
        for replica in self.order:
            mine = [w for w in cands if self.home[w.rid] == replica]
            took |= {w.rid for w in mine} - {w.rid for w in self.offer(replica, mine, best_effort, budgets)}
        for replica in self.order if self.adm.route_all else ():
            others = [w for w in cands if self.home[w.rid] != replica and w.rid not in took]
            took |= {w.rid for w in others} - {w.rid for w in self.offer(replica, others, best_effort, budgets)}
        return [w for w in cands if w.rid not in took]

    # ---- the steps ---------------------------------------------------------------------------------
    def offer_new(self) -> list[WaitingView]:
        """The offered requests planned in their own tiers; returns those every replica asked declined."""
        declined = self.route(list(self.offered), best_effort=False)
        for w in declined:
            count(self.adm.last.declined, w.tier)
        return declined

    def serve_declined(self, declined: list[WaitingView]) -> None:
        """One declined with an SLO some replica could meet alone is served without a TPOT guarantee where
        a replica can still start it within its TTFT (planned in the best-effort tier with its own TTFT
        deadline, at the passes' expected times: what FIFO would serve in time, at light load); one that
        allows best effort waits for spare capacity; the rest are refused."""
        spare = [w for w in declined if w.rid in self.best_effort_ok
                 or self.adm.alone(w, self.up, self.view.limits.max_prefill_tokens)]
        waits = {w.rid for w in self.route(spare, True, self.points(False) if spare else self.budgets)
                 if w.rid in self.best_effort_ok}
        admitted = {a.rid for a in self.admit}
        for w in declined:
            if w.rid in admitted:
                count(self.adm.last.best_effort, w.tier)
            elif w.rid in waits:
                self.defer[w.rid] = "best effort: waits for spare capacity"
            else:
                self.refuse(w)

    def decide_queue(self) -> None:
        """The queue beyond the offer (its first LOOKAHEAD), in order: each SLO request is decided now, as
        SLOs-Serve decides every new request at its first plan: admitted on the first replica that takes
        it alone beside every request ahead of it that one holds (each asks the replicas from the next
        one in turn, so that the queue spreads as round robin would), refused if none does. Beyond the
        DP's budget the choice is greedy in arrival order; one that may run best effort waits its turn."""
        max_new = self.adm.max_new
        for j, w in enumerate(self.view.waiting[max_new:max_new + LOOKAHEAD]):
            if w.best_effort or w.rid in self.best_effort_ok:
                continue
            del self.defer[w.rid]
            turn = _rotated(self.order, j)
            replica = next((k for k in turn if w.rid in self.plan_on(k, [w], False)[0]), None)
            if replica is None:
                self.refuse(w)
            else:
                self.take(replica, w, False)
                self.ahead.append(w)

    def next_due(self) -> dict[int, float]:
        """Per replica, ms until the first of its SLO decoders' next tokens is due (a TPOT is a mean: a
        decoder with o tokens after its first, l ms since it, owes its next by (o + 1)·TPOT − l)."""
        due: dict[int, float] = {}
        for r in self.view.decoding:
            tpot = self.tpot_of[r.rid]
            if tpot < BEST_EFFORT_TPOT_MS:  # the best-effort tier's TPOT: none is due
                due[r.replica] = min(due.get(r.replica, math.inf), (r.decoded + 1) * tpot - r.decode_elapsed_ms)
        return due

    def proposal(self) -> Proposal:
        """What the plan decided, with each replica's prompt chunks; the preempted leave the best-effort tier."""
        chunks, per_replica = prefill_chunks(self.view, self.budgets, self.base, self.held,
                                             {w.rid for w in self.offered + self.ahead}, self.next_due(),
                                             self.at_slo(BEST_EFFORT_TPOT_MS))
        for rid in self.preempt:
            self.adm.best_effort.discard(rid)
            self.adm.tier_of.pop(rid, None)
        return Proposal(self.admit, self.defer, chunks, per_replica, self.reject, self.preempt)
def paces(view: SchedulerView, tpot_of: dict[str, float]) -> dict[float, float]:
    """Per tier with decoders, the ms per token its decoders may all take from now on and still meet
    their TPOT (a TPOT is a mean over a request's tokens: the slowest pace among them, never below
    the SLO). A request of the tier that starts now (offered, prefilling) is planned at the SLO
    beside them, from its prefill deadline on: until then the decoders' pace sets the batches."""
    paces: dict[float, float] = {}
    for r in view.decoding:
        t = tpot_of[r.rid]
        if t < BEST_EFFORT_TPOT_MS:
            paces[t] = min(paces.get(t, math.inf), max(t, r.pace_ms()))
    return paces

def replica_budget(cost: PassCost, loads: list[TierLoad], steps: int, decoders: int, attending: int,
            max_prefill: int, prefill_first: bool, margin: bool, prices: Prices | None = None) -> ReplicaBudget:
    """A replica's budget at one operating point: the tiers' loads and the draft call's depth; with
    `prefill_first`, batches with nothing decoding are the engine's largest passes; `margin`: passes
    priced with the cost model's margin (else at their expected time)."""
    prices = prices or Prices()
    longest = prices.pricer(cost, steps, attending, margin)(max_prefill + decoders)
    # with nothing decoding, batches last the tightest tier's length (its TPOT times the tokens
    # a pass gives it, the speculation prior included) that holds a token without a draft call:
    # the prompts admitted now decode at that pace once prefilled (planning them only in the
    # largest chunks admitted a burst's requests that then missed their TTFT); prefill-first, the
    # largest pass (the chunks' deadline floor keeps the prompts the plan admits within their TTFT)
    idle = min((n for n in (min(t.tpot_ms * t.gain, longest) for t in loads if t.paced)
                if cost.fits(1, n, 0, attending, margin)), default=longest) if not prefill_first else longest
    return ReplicaBudget(cost, loads, idle, steps, attending, longest, margin, prices)


def count(where: dict[str, int], tier: str) -> None:
    where[tier] = where.get(tier, 0) + 1


def _rotated(seq: list[int], k: int) -> list[int]:
    """`seq` begun at its k-th element (modulo its length), wrapping around."""
    if not seq:
        return seq
    k %= len(seq)
    return seq[k:] + seq[:k]


def retry_after(view: SchedulerView) -> float:
    """Seconds until the soonest running request is expected to finish (1 to 60)."""
    soonest = min((r.remaining * r.tpot_ms / 1e3 for r in view.decoding), default=1.0)
    return min(60.0, max(1.0, soonest))


__all__ = ["BEST_EFFORT_TPOT_MS", "LOOKAHEAD", "AdmissionCounts", "AdmissionState", "SloRound", "retry_after"]
