"""SLO-aware admission (SLOs-Serve): the scheduler's proposal stage when `--admission slo`.

Each iteration, for each target replica, a planner (dp.py over budget_model.py) takes the replica's
decoding requests (a constant per tier, at the pace they may all keep: a TPOT is a mean over a
request's tokens, so decoders ahead of it allow longer batches until a new request's first token),
its requests still prefilling (forced nodes) and the new requests offered to it, and admits the
largest set whose TTFT and TPOT SLOs can all be met. Soft admission (digest §8):

1. each new request is offered first to the replica the router picks for it (so one iteration's
   arrivals spread as under FIFO); one that replica declines is offered to the others with
   `--router slo` (every replica, in a rotating order); with `round-robin` / `least-loaded` only the
   router's pick is asked;
2. then, if it allows best effort (`service_tier: "flex"`), it waits in the best-effort tier and is
   admitted when a replica can take it with no TTFT bound at the loosest TPOT, and always by a
   replica with nothing to run (work conserving: whatever the model says, an idle replica is spare);
3. otherwise it is refused at once: 503 with a Retry-After from the plan (when the soonest running
   request on any replica is expected to finish). One that cannot meet its TTFT even with every
   replica's passes given to the prompts due before it (`arrival.first_token_bound_ms`) is refused on arrival;
   of the queue behind the offer, the first `LOOKAHEAD` are decided in the same plan, greedily in
   arrival order: each admitted where a replica takes it alone beside every request ahead of it, else
   refused, so that a request learns its fate at the first plan that sees it.

A best-effort request, once admitted, is planned as a decoder with no TPOT: it costs its tokens in
every batch but never sets the batch length.

Prompt chunks come from the plan: each replica's batch holds time2bs(T) tokens, the decoders take
theirs, and the rest goes to prompts in prefill-deadline order; at least as many as keep every prompt
not yet late within its deadline (the prompts due by it, over the batches of length T before it), at
most the engine's chunk. The floor is there because the plan counts a request as a decoder from its
prefill deadline, while the engine decodes it as soon as its prompt is in, which shrinks the batches
left for the prompts after it.

Batch lengths come from each replica's `PassCost` (cost.py: the gateway's one cost model, the same
the speculation policy prices its choices with, fed by the engine); each tier's cost
(nodes per pass) and gain (tokens per pass) are moving averages of what the speculation policy in use
really did, less the nodes it added only from a pass's slack (`Policy.filler`: `joint`'s side
branches, which more decoders crowd out). No I/O, no clock.

Each replica is planned at two operating points, and a request is admitted if either admits it: the
measured one (each tier's cost and gain as above, every pass priced with the draft call's moving
depth) and plain decoding (one node and one token per request, no draft call), which the speculation
policy can always fall back to (`joint` turns drafting off when it would push a request past its
pace). The measured point alone can price a tier's small measured gain together with a draft call in
every pass, and refuse a request that plain passes would serve (docs/benchmarks/sweep_default.md, "Two
operating points in the planner"). At the plain point prompts are prefilled first: while nothing
decodes its batches are the engine's largest pass, so a critical request that arrives while a long
prompt prefills is planned with both prompts in a few large passes and its decoding after, not in
batches of its TPOT from the start. Prompt chunks come from whichever point's batches hold the
replica's decoders with the most room.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.admission.arrival import first_token_bound_ms
from specserve.gateway.sched.admission.budget import TierLoad
from specserve.gateway.sched.admission.budget_model import ReplicaBudget, best_plan, prefill_chunks
from specserve.gateway.sched.admission.dp import Node
from specserve.gateway.sched.plan import Admit, Proposal, Reject, ReplicaView, RequestView, SchedulerView, WaitingView
from specserve.gateway.sched.policy.goodput import Acceptance

BEST_EFFORT_TPOT_MS = 1e6  # best effort has no TPOT: it never sets the batch length, yet costs its tokens
BEST_EFFORT_DEADLINE_MS = 3.6e6  # no TTFT bound: an hour stands for "whenever"
LOOKAHEAD = 32  # requests beyond the offer decided each plan, greedily (a one-node DP each, 0.1-0.5 ms)


@dataclass(slots=True)
class TierStats:
    cost: float = 1.0  # nodes verified per request per pass (moving average)
    gain: float = 1.0  # tokens emitted per request per pass (moving average)


@dataclass(slots=True)
class AdmissionCounts:
    """What the last plan did, per tier name (the engine turns it into metrics)."""

    declined: dict[str, int] = field(default_factory=dict)  # a replica's planner said no
    best_effort: dict[str, int] = field(default_factory=dict)  # admitted in the best-effort tier
    refused: dict[str, int] = field(default_factory=dict)  # 503


class SloAdmission:
    name = "slo"

    def __init__(self, *, route_all: bool = True, max_new: int = 8, memory_buckets: int = 16,
                 smoothing: float = 0.1):
        self.route_all = route_all  # offer a declined request to every replica (SLO-aware routing)
        self.max_new = max_new  # new requests offered per iteration (the DP's complexity budget, digest)
        self.memory_buckets = memory_buckets
        self.smoothing = smoothing
        self.stats: dict[float, TierStats] = {}  # by TPOT, ms
        self.tier_of: dict[str, float] = {}  # rid -> its TPOT, ms (for observe)
        self.best_effort: set[str] = set()  # rids admitted in the best-effort tier
        self.spec_steps = 0.0  # moving average of the deepest beam per iteration
        self.spec_prior = (1.0, 1.0)  # (nodes, tokens) per pass the policy can give a tier that needs it
        self.acceptance = Acceptance()  # per-token acceptance of the drafted steps, whatever the policy
        self.last = AdmissionCounts()
        self._next = 0  # rotating first replica (SLO-aware routing)

    def observe(self, record: IterationRecord) -> None:
        a = self.smoothing
        depth = 0
        for s in record.verify_steps:
            depth = max(depth, s.depth)
            if s.depth > 0 and s.verified > 1:  # drafted: its deepest level's tokens were offered
                self.acceptance.observe(s.rid, min(s.depth, s.verified - 1), s.accepted)
            tpot = self.tier_of.get(s.rid)
            if tpot is None:
                continue
            st = self.stats.setdefault(tpot, TierStats())
            st.cost += a * (s.verified - s.filler - st.cost)
            st.gain += a * (max(s.emitted, 1) - st.gain)
        self.spec_steps += a * (depth - self.spec_steps)

    # ---- the proposal --------------------------------------------------------------------------
    def propose(self, view: SchedulerView, best_effort_ok: set[str], first: Mapping[str, int] | None) -> Proposal:
        """Admissions, deferrals, rejections and prompt chunks for this iteration. `first`: the replica the
        router picks for each waiting request, asked first (absent: this plan's rotating first replica)."""
        self._prune(view)
        tpot_of = {r.rid: self.tier_of.setdefault(r.rid, r.tpot_ms) for r in view.decoding}
        tpot_of.update({p.rid: self.tier_of.get(p.rid, p.tpot_ms) for p in view.prefilling})
        tpots = set(tpot_of.values()) | {w.tpot_ms for w in view.waiting}
        be_tpot = BEST_EFFORT_TPOT_MS
        # the DP's tiers, keyed (pace, TPOT SLO): a tier's decoders at the pace they may all keep
        # (`_paces`), every request that starts now (offered, prefilling) at its SLO
        paces = self._paces(view, tpot_of)
        slos = tpots | {be_tpot}
        key_of = {r.rid: (paces.get(tpot_of[r.rid], tpot_of[r.rid]), tpot_of[r.rid]) for r in view.decoding}
        tiers = sorted({(t, t) for t in slos} | set(key_of.values()))
        index = {k: i for i, k in enumerate(tiers)}

        def at_slo(tpot: float) -> int:
            """The DP's tier of a request that starts now with this TPOT SLO."""
            return index[(tpot, tpot)]

        up = [rep for rep in view.replicas if rep.up]
        rep_of = {rep.index: rep for rep in up}
        # the KV its passes attend to while the prompts admitted now prefill: what its requests hold, and
        # the prompts still to come in (output tokens grow it slowly; their reservation is not attended to)
        attend = {rep.index: rep.held_blocks + sum(rep.blocks_for(p.prompt_tokens - p.prefilled)
                                                   for p in view.prefilling if p.replica == rep.index) for rep in up}
        steps = round(self.spec_steps)
        needs = {t for t in slos if any(rep.cost.time2bs(t, steps, attend[rep.index]) < 2 for rep in up)}
        measuring = set(tpot_of.values())  # tiers with requests running now: what they get is measured
        offered = view.waiting[:self.max_new]
        loads = [self._load(t, t in needs and t not in measuring, pace) for pace, t in tiers]

        base = {rep.index: [0] * len(tiers) for rep in up}
        for r in view.decoding:
            if r.replica in base:
                base[r.replica][index[key_of[r.rid]]] += 1
        plain = [TierLoad(t.tpot_ms, paced=t.paced) for t in loads]

        def points(margin: bool) -> dict[int, list[ReplicaBudget]]:
            return {rep.index: [self._budget(rep.cost, ls, st, sum(base[rep.index]), attend[rep.index],
                                             view.limits.max_prefill_tokens, first, margin)
                                for ls, st, first in ((loads, steps, False), (plain, 0, True))] for rep in up}

        budgets = points(True)
        held = {rep.index: [Node(p.rid, at_slo(tpot_of[p.rid]), p.prompt_tokens - p.prefilled,
                                 p.ttft_ms - p.waited_ms, 0, True) for p in view.prefilling if p.replica == rep.index]
                for rep in up}  # forced nodes: admitted before, and those admitted in this plan
        free = {rep.index: rep.free_blocks for rep in up}
        slots = {rep.index: max(0, view.limits.max_running - rep.running) for rep in up}
        baseline = {rep.index: rep.cost.baseline_iteration_ms for rep in up}  # the profile's, never refitted

        best_effort_on = {rep.index: [r for r in view.decoding if r.replica == rep.index and r.rid in self.best_effort]
                          for rep in up}
        preempt: list[str] = []
        admit: list[Admit] = []
        defer = {w.rid: "waits its turn: the planner takes a few new requests per iteration"
                 for w in view.waiting[self.max_new:]}
        reject: dict[str, Reject] = {}

        def deadline(w: WaitingView, best_effort: bool) -> float:
            """Its prefill deadline: none in the best-effort tier if it allows that, else its TTFT's."""
            return BEST_EFFORT_DEADLINE_MS if best_effort and w.rid in best_effort_ok else w.ttft_ms - w.waited_ms

        def nodes(cands: list[WaitingView], best_effort: bool, slots_: int, free_: int, unit: int) -> list[Node]:
            """The DP's new nodes: the candidates that fit this replica's free slots and blocks."""
            return [Node(w.rid, at_slo(be_tpot if best_effort else w.tpot_ms), w.prompt_tokens,
                         deadline(w, best_effort),
                         math.ceil(w.kv_blocks / unit))
                    for w in cands[:slots_] if w.kv_blocks <= free_]

        def plan_on(replica: int, cands: list[WaitingView], best_effort: bool, held_: dict[int, list[Node]],
                    free_: dict[int, int], slots_: dict[int, int],
                    budgets_: dict[int, list[ReplicaBudget]] = budgets) -> tuple[set[str], list[ReplicaBudget]]:
            """The DP's admissions among these candidates on this replica beside its forced nodes `held_`,
            and the operating points it planned at (`budgets_`: with the cost model's margin, or without)."""
            unit = max(1, math.ceil(free_[replica] / self.memory_buckets))
            new = nodes(cands, best_effort, slots_[replica], free_[replica], unit)
            # the passes attend to the KV held now plus an arrival's prompt: exact for one arrival (the
            # usual case); when several are admitted at once, the next plans see all their prompts
            attending = attend[replica] + max((rep_of[replica].blocks_for(w.prompt_tokens) for w in cands), default=0)
            at = [b.attending(attending) for b in budgets_[replica]]
            return (best_plan(held_[replica] + new, base[replica], free_[replica] // unit, at) if new
                    else set()), at

        def hold(replica: int, w: WaitingView, best_effort: bool, held_: dict[int, list[Node]],
                 free_: dict[int, int], slots_: dict[int, int]) -> None:
            """A request planned as admitted on this replica: a forced node, its blocks and slot taken."""
            tpot = be_tpot if best_effort else w.tpot_ms
            held_[replica].append(Node(w.rid, at_slo(tpot), w.prompt_tokens, deadline(w, best_effort), 0, True))
            free_[replica] -= w.kv_blocks
            slots_[replica] -= 1
            attend[replica] += rep_of[replica].blocks_for(w.prompt_tokens)

        def take(replica: int, w: WaitingView, best_effort: bool) -> None:
            """Admit the request on this replica in this plan (in the best-effort tier, or its own)."""
            admit.append(Admit(w.rid, replica))
            hold(replica, w, best_effort, held, free, slots)
            self.tier_of[w.rid] = be_tpot if best_effort else w.tpot_ms
            if best_effort:
                self.best_effort.add(w.rid)

        retry_s = retry_after(view)

        def refuse(w: WaitingView) -> None:
            self._count(self.last.refused, w.tier)
            reject[w.rid] = Reject("no target replica can meet this request's SLO now", retry_s)

        def offer(replica: int, cands: list[WaitingView], best_effort: bool,
                  budgets_: dict[int, list[ReplicaBudget]] = budgets) -> list[WaitingView]:
            """Plan this replica with these candidates; returns the ones it declined."""
            if not cands:
                return cands
            took, at = plan_on(replica, cands, best_effort, held, free, slots, budgets_)
            if not took and not any(base[replica]) and not held[replica] and slots[replica] > 0:
                # work conserving: an idle replica is spare capacity whatever its refitted model says. A
                # bad refit kept one idle beside a waiting best-effort request for good, and another
                # refusing every lone critical request (with nothing running, the model never learns
                # otherwise); an SLO request is taken if the profile's decode iteration meets its TPOT
                # and its TTFT is not already lost
                first = next((w for w in cands if w.kv_blocks <= free[replica] and (best_effort or (
                    w.tpot_ms >= baseline[replica] and w.waited_ms < w.ttft_ms))), None)
                took = {first.rid} if first is not None else took
            if not best_effort and len(took) < len(cands) and best_effort_on[replica]:
                took = self._preempt_for(replica, held[replica], cands, nodes, took, best_effort_on, base, free,
                                         slots, at, index, key_of, preempt)
            for w in cands:
                if w.rid in took:
                    take(replica, w, best_effort)
            return [w for w in cands if w.rid not in took]

        order = _rotated([rep.index for rep in up], self._next)
        if order:
            self._next += 1
        home = {w.rid: first[w.rid] if first and first.get(w.rid) in order else order[0]
                for w in offered} if order else {}

        def route(cands: list[WaitingView], best_effort: bool,
                  budgets_: dict[int, list[ReplicaBudget]] = budgets) -> list[WaitingView]:
            """Each candidate asks its own replica first (the router's pick); with `route_all`, those it
            declines ask every other replica in turn. Returns the declined, in arrival order."""
            took: set[str] = set()
            for replica in order:
                mine = [w for w in cands if home[w.rid] == replica]
                took |= {w.rid for w in mine} - {w.rid for w in offer(replica, mine, best_effort, budgets_)}
            for replica in order if self.route_all else ():
                others = [w for w in cands if home[w.rid] != replica and w.rid not in took]
                took |= {w.rid for w in others} - {w.rid for w in offer(replica, others, best_effort, budgets_)}
            return [w for w in cands if w.rid not in took]

        declined = route(list(offered), best_effort=False)
        for w in declined:
            self._count(self.last.declined, w.tier)
        # one it declines with an SLO some replica could meet alone is served without a TPOT guarantee where
        # a replica can still start it within its TTFT (planned in the best-effort tier with its own TTFT
        # deadline, at the passes' expected times: what FIFO would serve in time, at light load); else refused
        spare = [w for w in declined if w.rid in best_effort_ok or self._alone(w, up, view.limits.max_prefill_tokens)]
        waits = {w.rid for w in route(spare, True, points(False) if spare else budgets) if w.rid in best_effort_ok}
        admitted = {a.rid for a in admit}
        for w in declined:
            if w.rid in admitted:
                self._count(self.last.best_effort, w.tier)
            elif w.rid in waits:
                defer[w.rid] = "best effort: waits for spare capacity"
            else:
                refuse(w)

        # the queue beyond the offer (its first LOOKAHEAD), in order: each SLO request is decided now, as
        # SLOs-Serve decides every new request at its first plan: admitted on the first replica that takes
        # it alone beside every request ahead of it that one holds (each asks the replicas from the next
        # one in turn, so that the queue spreads as round robin would), refused if none does. Beyond the
        # DP's budget the choice is greedy in arrival order; one that may run best effort waits its turn
        ahead: list[WaitingView] = []
        for j, w in enumerate(view.waiting[self.max_new:self.max_new + LOOKAHEAD]):
            if w.best_effort or w.rid in best_effort_ok:
                continue
            del defer[w.rid]
            turn = _rotated(order, j)
            replica = next((k for k in turn if w.rid in plan_on(k, [w], False, held, free, slots)[0]), None)
            if replica is None:
                refuse(w)
            else:
                take(replica, w, False)
                ahead.append(w)
        chunks, per_replica = prefill_chunks(view, budgets, base, held, offered + ahead, at_slo(be_tpot))
        for rid in preempt:
            self.best_effort.discard(rid)
            self.tier_of.pop(rid, None)
        return Proposal(admit, defer, chunks, per_replica, reject, preempt)

    def _alone(self, w: WaitingView, up: list[ReplicaView], chunk: int) -> bool:
        """Whether a replica with nothing else to run could meet the request's SLO (its cost model: the
        prompt in passes of `chunk`, then decode passes of one token or of the policy's prior)."""
        nodes, tokens = self.spec_prior
        return any(w.waited_ms + first_token_bound_ms(w.prompt_tokens, 0, [rep.cost], chunk) <= w.ttft_ms
                   and min(rep.cost.planned_ms(1), rep.cost.planned_ms(math.ceil(nodes), 1) / tokens) <= w.tpot_ms
                   for rep in up)

    def _preempt_for(self, replica: int, held: list[Node], cands: list[WaitingView],
                     nodes: Callable[[list[WaitingView], bool, int, int, int], list[Node]], took: set[str],
                     best_effort_on: dict[int, list[RequestView]], base: dict[int, list[int]], free: dict[int, int],
                     slots: dict[int, int], points: list[ReplicaBudget], index: dict[tuple[float, float], int],
                     key_of: dict[str, tuple[float, float]], preempt: list[str]) -> set[str]:
        """SLO arrivals come before best effort (digest §8): plan again as if the replica's k best-effort
        requests with the least output (the cheapest to recompute) gave their KV back, k = 1, 2, 4, ...;
        the first k that admits more is preempted."""
        victims = sorted(best_effort_on[replica], key=lambda r: r.decoded)
        k = 1
        while True:
            k = min(k, len(victims))
            going = victims[:k]
            base2 = list(base[replica])
            for r in going:
                base2[index[key_of[r.rid]]] -= 1
            free2 = free[replica] + sum(r.kv_blocks for r in going)
            unit2 = max(1, math.ceil(free2 / self.memory_buckets))
            new2 = nodes(cands, False, slots[replica] + k, free2, unit2)
            took2 = best_plan(held + new2, base2, free2 // unit2, points)
            if len(took2) > len(took):
                preempt.extend(r.rid for r in going)
                best_effort_on[replica] = victims[k:]
                base[replica], free[replica] = base2, free2
                slots[replica] += k
                return took2
            if k == len(victims):
                return took
            k *= 2

    @staticmethod
    def _paces(view: SchedulerView, tpot_of: dict[str, float]) -> dict[float, float]:
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

    @staticmethod
    def _budget(cost: PassCost, loads: list[TierLoad], steps: int, decoders: int, attending: int,
                max_prefill: int, prefill_first: bool, margin: bool) -> ReplicaBudget:
        """A replica's budget at one operating point: the tiers' loads and the draft call's depth; with
        `prefill_first`, batches with nothing decoding are the engine's largest passes; `margin`: passes
        priced with the cost model's margin (else at their expected time)."""
        longest = cost.planned_ms(max_prefill + decoders, steps, attending, margin)
        # with nothing decoding, batches last the tightest tier's length (its TPOT times the tokens
        # a pass gives it, the speculation prior included) that holds a token without a draft call:
        # the prompts admitted now decode at that pace once prefilled (planning them only in the
        # largest chunks admitted a burst's requests that then missed their TTFT); prefill-first, the
        # largest pass (the chunks' deadline floor keeps the prompts the plan admits within their TTFT)
        idle = min((n for n in (min(t.tpot_ms * t.gain, longest) for t in loads if t.paced)
                    if cost.time2bs(n, 0, attending, margin) >= 1), default=longest) if not prefill_first else longest
        return ReplicaBudget(cost, loads, idle, steps, attending, longest, margin)

    def _load(self, tpot: float, prior: bool, pace: float) -> TierLoad:
        """A tier's measured cost and gain, its batches paced at `pace` ms per token (its TPOT, or
        slower where its decoders are ahead of it); with `prior` (its batch cannot hold two tokens without
        speculation, and none of its requests runs now to measure what the policy gives it), at least
        the policy's prior: what it measured earlier, at another load, does not say what it gets now."""
        if tpot >= BEST_EFFORT_TPOT_MS:
            return TierLoad(tpot, paced=False)
        st = self.stats.get(tpot)
        cost, gain = (st.cost, st.gain) if st is not None else (1.0, 1.0)
        if prior and self.spec_prior[1] > gain:
            cost, gain = self.spec_prior
        if cost <= 1.0 + 1e-6 and gain <= 1.0 + 1e-6:
            return TierLoad(pace)
        return TierLoad(pace, max(cost, 1.0), max(gain, 1.0))

    def _prune(self, view: SchedulerView) -> None:
        """Forget requests that are gone (the scheduler never hears of a finish)."""
        keep = view.live_rids
        if len(self.tier_of) > 2 * len(keep) + 64:
            self.tier_of = {k: v for k, v in self.tier_of.items() if k in keep}
            self.best_effort = {rid for rid in self.best_effort if rid in keep}
            self.acceptance.forget(keep)

    @staticmethod
    def _count(where: dict[str, int], tier: str) -> None:
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


__all__ = ["AdmissionCounts", "SloAdmission", "retry_after"]
