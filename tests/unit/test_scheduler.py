"""The scheduler (specserve.gateway.sched.scheduler) on hand-built snapshots: no processes, no clock.

Covers the FIFO proposal (routing, head-of-line, chunks per replica), the enforcement of the hard
limits on whatever a policy decides (capacity, replica hints, rejections, chunk and shape caps,
the draft's state), the routers, and that the default decision asks the policy's shapes per
replica with that replica's own prefill tokens.
"""

from __future__ import annotations

import pytest

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.plan import (
    Admit,
    Decision,
    DraftView,
    Limits,
    PrefillView,
    Reject,
    ReplicaView,
    RequestView,
    Residency,
    SchedulerView,
    Shape,
    WaitingView,
)
from specserve.gateway.sched.policy import Policy, make_policy
from specserve.gateway.sched.routing import LeastLoaded, Ledger, RoundRobin, make_router
from specserve.gateway.sched.scheduler import Scheduler


def replica(i: int, *, up: bool = True, total: int = 100, reserved: int = 0, running: int = 0,
            budget: int = 16) -> ReplicaView:
    return ReplicaView(i, up, total, reserved, running, PassCost(budget, 10.0))


def waiting(rid: str, *, prompt: int = 10, blocks: int = 10) -> WaitingView:
    return WaitingView(rid, prompt, 20, blocks, "chat", 50.0, 1000.0, 0.0)


def decoding(rid: str, replica: int = 0, *, remaining: int = 100, lag: int = 0) -> RequestView:
    return RequestView(rid, "chat", 50.0, 1000.0, 5, 100.0, remaining, [], replica, lag)


def view(*, waiting_=(), prefilling=(), decoding_=(), replicas=None, draft=None,
         max_running=64, max_prefill=256) -> SchedulerView:
    draft = draft or DraftView(True, False)
    return SchedulerView(list(waiting_), list(prefilling), list(decoding_), replicas or [replica(0)], draft,
                         Limits(max_running, max_prefill, 16, 16))


class Scripted(Policy):
    """A policy that returns a fixed decision (admission lists refer to the view's requests)."""

    uses_draft = True

    def __init__(self, decision: Decision):
        self.decision = decision

    def decide(self, view: SchedulerView) -> Decision:
        return self.decision


# ---------------------------------------------------------------- the FIFO proposal


def test_fifo_admits_in_order_and_stops_at_the_first_that_does_not_fit():
    v = view(waiting_=[waiting("a", blocks=40), waiting("b", blocks=50), waiting("c", blocks=30),
                       waiting("d", blocks=5)])
    plan = Scheduler(Policy(), RoundRobin()).plan(v, 1)
    assert [(a.rid, a.replica) for a in plan.admitted] == [("a", 0), ("b", 0)]
    assert list(plan.deferred) == ["c"] and "room" in plan.deferred["c"]  # d would fit, but waits behind c
    assert plan.chunks == {"a": 10, "b": 10}


def test_round_robin_spreads_and_skips_replicas_that_are_down_or_full():
    reps = [replica(0), replica(1), replica(2, up=False)]
    plan = Scheduler(Policy(), RoundRobin()).plan(view(waiting_=[waiting(x) for x in "abcd"], replicas=reps), 1)
    assert [a.replica for a in plan.admitted] == [0, 1, 0, 1]
    reps = [replica(0, reserved=95), replica(1)]  # replica 0 cannot take 10 more blocks
    plan = Scheduler(Policy(), RoundRobin()).plan(view(waiting_=[waiting("a"), waiting("b")], replicas=reps), 1)
    assert [a.replica for a in plan.admitted] == [1, 1]


def test_round_robin_continues_where_the_last_plan_stopped():
    sched = Scheduler(Policy(), RoundRobin())
    reps = [replica(0), replica(1), replica(2)]
    assert [a.replica for a in sched.plan(view(waiting_=[waiting("a")], replicas=reps), 1).admitted] == [0]
    assert [a.replica for a in sched.plan(view(waiting_=[waiting("b")], replicas=reps), 2).admitted] == [1]
    assert [a.replica for a in sched.plan(view(waiting_=[waiting("c")], replicas=reps), 3).admitted] == [2]


def test_least_loaded_picks_the_emptiest_pool_then_fewest_requests():
    reps = [replica(0, reserved=30), replica(1, reserved=10, running=3), replica(2, reserved=10, running=1)]
    plan = Scheduler(Policy(), LeastLoaded()).plan(view(waiting_=[waiting("a", blocks=5)], replicas=reps), 1)
    assert plan.admitted == [Admit("a", 2)]
    # after a takes 5 blocks on 2 (15 reserved), b goes to 1 (10 reserved)
    plan = Scheduler(Policy(), LeastLoaded()).plan(view(waiting_=[waiting("a", blocks=5), waiting("b", blocks=5)],
                                                        replicas=reps), 1)
    assert [a.replica for a in plan.admitted] == [2, 1]


def test_no_replica_up_defers_with_that_reason():
    plan = Scheduler(Policy(), RoundRobin()).plan(view(waiting_=[waiting("a")], replicas=[replica(0, up=False)]), 1)
    assert plan.admitted == [] and plan.deferred == {"a": "no target replica is up"}


def test_max_running_per_replica():
    reps = [replica(0, running=2), replica(1, running=1)]
    plan = Scheduler(Policy(), RoundRobin()).plan(view(waiting_=[waiting("a"), waiting("b")], replicas=reps,
                                                       max_running=2), 1)
    assert plan.admitted == [Admit("a", 1)] and list(plan.deferred) == ["b"]


def test_chunks_per_replica_prefilling_first():
    prefilling = [PrefillView("p0", 0, 500, 100, "chat", 50.0, 1000.0, 0.0),
                  PrefillView("p1", 1, 50, 0, "chat", 50.0, 1000.0, 0.0)]
    reps = [replica(0), replica(1)]
    v = view(waiting_=[waiting("a", prompt=300), waiting("b", prompt=300)], prefilling=prefilling, replicas=reps,
             max_prefill=256)
    plan = Scheduler(Policy(), RoundRobin()).plan(v, 1)
    assert [(a.rid, a.replica) for a in plan.admitted] == [("a", 0), ("b", 1)]
    # replica 0: p0 takes its whole budget (400 left); replica 1: p1's 50, then b's first 206
    assert plan.chunks == {"p0": 256, "p1": 50, "b": 206}
    assert [b.prefill_tokens for b in plan.batches] == [256, 256]


# ---------------------------------------------------------------- enforcement of a policy's decision


def test_enforce_defers_an_admission_that_does_not_fit_and_honours_hints():
    reps = [replica(0, reserved=95), replica(1)]
    v = view(waiting_=[waiting("a"), waiting("b"), waiting("c", blocks=200)], replicas=reps)
    d = Decision(admit=[Admit("a", 0), Admit("b", 1), Admit("c"), Admit("ghost")], strict_order=False)
    plan = Scheduler(Scripted(d), RoundRobin()).plan(v, 1)
    # a's hint (0) is full: the router places it on 1; b's hint 1 fits; c fits nowhere; ghost is unknown
    assert [(a.rid, a.replica) for a in plan.admitted] == [("a", 1), ("b", 1)]
    assert list(plan.deferred) == ["c"]


def test_enforce_strict_order_stops_at_the_first_misfit():
    v = view(waiting_=[waiting("a", blocks=200), waiting("b")])
    plan = Scheduler(Scripted(Decision(admit=[Admit("a"), Admit("b")])), RoundRobin()).plan(v, 1)
    assert plan.admitted == [] and set(plan.deferred) == {"a", "b"} and "behind a" in plan.deferred["b"]


def test_enforce_keeps_rejections_and_deferrals_with_reasons():
    v = view(waiting_=[waiting("a"), waiting("b"), waiting("c")])
    d = Decision(admit=[Admit("a"), Admit("b")], defer={"c": "TTFT plan"},
                 reject={"b": Reject("SLO unattainable", 2.5), "zz": Reject("not waiting")})
    plan = Scheduler(Scripted(d), RoundRobin()).plan(v, 1)
    assert plan.admitted == [Admit("a", 0)]
    assert plan.rejected == {"b": Reject("SLO unattainable", 2.5)}
    assert plan.deferred == {"c": "TTFT plan"}


def test_enforce_cuts_chunks_to_the_prompt_and_the_replica_limit():
    prefilling = [PrefillView("p", 0, 100, 90, "chat", 50.0, 1000.0, 0.0)]
    v = view(waiting_=[waiting("a", prompt=300)], prefilling=prefilling, max_prefill=64)
    d = Decision(admit=[Admit("a")], chunks={"p": 50, "a": 300, "ghost": 10})
    plan = Scheduler(Scripted(d), RoundRobin()).plan(v, 1)
    assert plan.chunks == {"p": 10, "a": 54}  # p has 10 left; a gets the rest of the 64


def test_enforce_cuts_shapes_and_turns_them_off_without_a_usable_draft():
    reqs = [decoding("a", remaining=3), decoding("b"), decoding("c")]
    d = Decision(admit=[], shapes={"a": Shape(8, 2), "b": Shape(40, 99)})
    plan = Scheduler(Scripted(d), RoundRobin()).plan(view(decoding_=reqs), 1)
    assert plan.shapes == {"a": Shape(2, 2), "b": Shape(16, 16), "c": Shape(0, 1)}
    assert plan.speculating == ["a", "b"]
    for draft in (DraftView(False, False), DraftView(True, True)):
        plan = Scheduler(Scripted(d), RoundRobin()).plan(view(decoding_=reqs, draft=draft), 1)
        assert all(s.depth == 0 for s in plan.shapes.values())


def test_enforce_drops_a_residency_change_already_in_effect():
    for draft, asked, expected in [
        (DraftView(True, False), Residency.OFFLOAD, Residency.OFFLOAD),
        (DraftView(True, True), Residency.OFFLOAD, Residency.KEEP),
        (DraftView(True, True), Residency.RELOAD, Residency.RELOAD),
        (DraftView(True, False), Residency.RELOAD, Residency.KEEP),
        (DraftView(False, False), Residency.OFFLOAD, Residency.KEEP),
    ]:
        plan = Scheduler(Scripted(Decision(admit=[], residency=asked)), RoundRobin()).plan(view(draft=draft), 1)
        assert plan.residency is expected, (draft, asked)
    # the iteration that offloads does not speculate
    d = Decision(admit=[], shapes={"a": Shape(3, 1)}, residency=Residency.OFFLOAD)
    plan = Scheduler(Scripted(d), RoundRobin()).plan(view(decoding_=[decoding("a")]), 1)
    assert plan.residency is Residency.OFFLOAD and plan.shapes == {"a": Shape(0, 1)}


def test_eager_draft_sync_lists_lagging_requests_that_do_not_speculate():
    reqs = [decoding("a", lag=3), decoding("b", lag=0), decoding("c", lag=2)]
    d = Decision(admit=[], shapes={"c": Shape(2, 1)})
    assert Scheduler(Scripted(d), RoundRobin(), sync_draft=True).plan(view(decoding_=reqs), 1).draft_sync == ["a"]
    assert Scheduler(Scripted(d), RoundRobin()).plan(view(decoding_=reqs), 1).draft_sync == []


# ---------------------------------------------------------------- the default decision


def test_default_decision_shapes_per_replica_with_its_own_prefill():
    """AdaServe's eq. 8-9 per replica: B = 16 each; replica 0 co-schedules 8 prompt tokens, replica 1 none."""
    prefilling = [PrefillView("p", 0, 8, 0, "chat", 50.0, 1000.0, 0.0)]
    reqs = [decoding("a", 0), decoding("b", 0), decoding("c", 1), decoding("d", 1)]
    v = view(prefilling=prefilling, decoding_=reqs, replicas=[replica(0), replica(1)])
    plan = Scheduler(make_policy("adaserve"), RoundRobin()).plan(v, 1)
    # replica 0: 16 - 8 = 8 for 2 requests -> d = 4, w = 4; replica 1: 16 for 2 -> d = 8, w = 4 (W_max)
    assert plan.shapes == {"a": Shape(4, 4), "b": Shape(4, 4), "c": Shape(8, 4), "d": Shape(8, 4)}
    assert [[r.rid for r in b.requests] for b in plan.batches] == [["a", "b"], ["c", "d"]]
    assert [b.prefill_tokens for b in plan.batches] == [8, 0]


def test_none_policy_never_speculates():
    plan = Scheduler(Policy(), RoundRobin()).plan(view(decoding_=[decoding("a")]), 1)
    assert plan.shapes == {"a": Shape(0, 1)} and plan.speculating == []


# ---------------------------------------------------------------- routers


def test_ledger_fits():
    led = Ledger(True, 100, 90, 3)
    assert led.fits(10, 4) and not led.fits(11, 4) and not led.fits(10, 3)
    assert not Ledger(False, 100, 0, 0).fits(1, 4)


def test_make_router():
    assert isinstance(make_router("round-robin"), RoundRobin)
    assert isinstance(make_router("least-loaded"), LeastLoaded)
    with pytest.raises(ValueError, match="round-robin"):
        make_router("random")
