"""`joint`'s side branches (sched/policy/branching.py): trees where the draft offers them and the cost
model says they pay, chains elsewhere."""

from __future__ import annotations

import pytest

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.perf.record import IterationRecord, RequestStep
from specserve.gateway.sched.policy import BatchView, CandidateTree, RequestView, Shape, make_policy
from specserve.gateway.sched.policy.branching import Branches, spine
from specserve.gateway.sched.policy.joint import Joint

FREE, MID, DEAR = 1 / 63, 1.8, 6.0  # ms a verified token costs the target


def cost(slope: float) -> PassCost:
    """A target pass of 10 ms at one token plus `slope` ms a token, and a draft call of 0.5 ms plus 1 ms a
    beam step whatever its width."""
    c = PassCost(budget_tokens=64, baseline_iteration_ms=10.0 + 7 * slope, curve=[(1, 10.0), (64, 10.0 + 63 * slope)])
    c.draft.theta = [0.5, 1.0, 0.0, 0.0]
    return c


def req(rid: str, *, tpot: float = 1000.0, decoded: int = 10, elapsed: float = 100.0) -> RequestView:
    return RequestView(rid=rid, tier="t", tpot_ms=tpot, ttft_ms=1000.0, decoded=decoded, decode_elapsed_ms=elapsed,
                       remaining=100)


def forked(depth: int = 3) -> CandidateTree:
    """A chain of `depth` nodes (f̂ 0.6, 0.4, 0.3) with one sibling under every chain node's parent
    (f̂ 0.3, 0.15, 0.1): the n-gram draft's shape when two continuations were seen."""
    tokens, parents, probs = [1], [-1], [1.0]
    main = [0.6, 0.4, 0.3][:depth]
    side = [0.3, 0.15, 0.1][:depth]
    at = 0
    for level in range(depth):
        tokens += [10 + level, 20 + level]
        parents += [at, at]
        probs += [main[level], side[level]]
        at = len(tokens) - 2  # the chain continues under its main node
    return CandidateTree(tokens, parents, probs)


def test_spine_follows_the_most_probable_child():
    tree = forked()
    assert spine(tree) == [0, 1, 3, 5]
    assert [tree.tokens[v] for v in spine(tree)] == [1, 10, 11, 12]
    assert spine(CandidateTree.root_only(7)) == [0]


def grow(curve, rates=None, paces=None, branches=None, n=1):
    b = branches or Branches()
    batch = BatchView([req(f"r{i}") for i in range(n)])
    trees = {f"r{i}": forked() for i in range(n)}
    rates = rates or {f"r{i}": 0.5 for i in range(n)}
    paces = paces or {r.rid: r.pace_ms() for r in batch.requests}
    return b.grow(batch, trees, cost(curve), rates, paces), b


def test_side_nodes_are_verified_where_verification_is_cheap_and_chains_alone_where_it_is_dear():
    cheap, _ = grow(FREE)
    assert cheap["r0"] == [0, 1, 2, 3, 4, 5, 6]  # the chain and every sibling
    dear, _ = grow(DEAR)
    assert dear["r0"] == [0, 1, 3, 5]  # 6 ms for a side token at most 0.3 likely: the chain alone


def test_side_nodes_come_in_order_of_their_estimate_until_one_does_not_pay():
    # 1.8 ms a token: a side node pays when c f̂ T >= E dt; with the chain T = 10 + 3 * 1.8 + 3.5 = 18.9 ms
    # and E = l(0.5, 3) = 1.875: 0.3 pays (5.7 >= 3.4); then T = 20.7, E = 2.175, and 0.15 does not (3.1 < 3.9)
    mid, _ = grow(MID)
    assert mid["r0"] == [0, 1, 2, 3, 5]  # the 0.3 sibling pays; 0.15 and 0.1 do not


def test_a_side_node_never_makes_a_request_that_keeps_its_pace_late():
    step = cost(FREE).iteration_ms(4, 3, 1, 4)  # the pass with the chain, as `grow` predicts it
    e = 1.875  # l(0.5, 3): the chain's expected tokens
    tight = {"r0": (step + 0.01) / e}  # its chain keeps its pace with 0.01 ms to spare (a node costs 0.016)
    kept, _ = grow(FREE, paces=tight)
    assert kept["r0"] == [0, 1, 3, 5]
    roomy = {"r0": (step + 0.04) / e}  # room for two side nodes
    assert grow(FREE, paces=roomy)[0]["r0"] == [0, 1, 2, 3, 4, 5]  # the 0.3 and 0.15 siblings
    behind = {"r0": 5.0}  # already behind its pace: side nodes are priced by goodput alone
    assert grow(FREE, paces=behind)[0]["r0"] == [0, 1, 2, 3, 4, 5, 6]


def test_the_tree_budget_caps_the_pass():
    out, _ = grow(FREE, n=15)  # 15 chains of 4 nodes: 60 of the 64-token budget, 4 side nodes left
    assert sum(len(v) for v in out.values()) == 64


def record(accepted: dict[str, int]) -> IterationRecord:
    return IterationRecord(0, requests=[RequestStep(rid, 0, depth=3, width=4, verified=4, accepted=a, emitted=a + 1)
                                        for rid, a in accepted.items()])


def test_calibration_learns_that_the_drafts_probabilities_overstate_and_stops_paying_for_side_nodes():
    b = Branches()
    mid = MID
    assert grow(mid, branches=b)[0]["r0"] == [0, 1, 2, 3, 5]
    for _ in range(40):  # the target accepts nothing of what the draft believed likely
        grow(mid, branches=b)
        b.observe(record({"r0": 0}))
    assert b.calibration < 0.3
    assert grow(mid, branches=b)[0]["r0"] == [0, 1, 3, 5]
    for _ in range(200):  # and everything: side nodes pay again
        grow(mid, branches=b)
        b.observe(record({"r0": 3}))
    assert b.calibration > 1.5 and grow(mid, branches=b)[0]["r0"] == [0, 1, 2, 3, 4, 5]


def test_trees_are_asked_for_where_the_width_is_free_and_chains_where_it_is_dear_except_a_probe():
    b = Branches(probe_every=5)
    spec = [req("a")]
    free = cost(FREE)  # a draft whose width costs nothing (the n-gram draft)
    assert b.widen(free, spec, 3, 2.0, 20.0)
    dear = cost(FREE)
    dear.draft.theta = [0.5, 1.0, 2.0, 0.0]  # 2 ms a draft node: width 4 costs 18 ms more at depth 3
    b.gain = 0.0  # trees measured to add nothing
    asked = [b.widen(dear, spec, 3, 2.0, 20.0) for _ in range(10)]
    assert asked == [False, False, False, False, True] * 2  # a probe every 5 passes keeps the gain measured
    b.gain = 3.0  # three side tokens a pass: worth 30 ms at 0.1 tokens per ms
    assert b.widen(dear, spec, 3, 2.0, 20.0)


def test_joint_drafts_trees_where_they_pay_and_verifies_chains_whole():
    p = make_policy("joint")
    assert isinstance(p, Joint) and p.branches.width == 4
    lat = cost(FREE)
    batch = BatchView([req("a"), req("b")])
    shapes = p.shapes(batch, lat)
    k = p.control.current[0]
    assert k > 0 and shapes == {"a": Shape(k, 4), "b": Shape(k, 4)}
    trees = {"a": forked(), "b": CandidateTree([5, 6], [-1, 0], [1.0, 0.9])}
    selected = p.select(batch, trees, lat)
    assert selected == {"a": [0, 1, 2, 3, 4, 5, 6], "b": [0, 1]}
    assert p.control.proposed == {"a": 3, "b": 1}  # the acceptance estimate still sees chain depths
    p.observe(record({"a": 2, "b": 1}))
    assert p.branches.calibration == pytest.approx((3 + 4) / (0.6 + 0.3 + 0.4 + 0.15 + 0.3 + 0.1 + 0.9 + 4))


def test_side_nodes_are_filler_that_slo_admission_leaves_out_of_a_tiers_cost():
    from specserve.gateway.sched.admission.slo import SloAdmission
    p = make_policy("joint")
    lat = cost(FREE)
    batch = BatchView([req("a")])
    p.shapes(batch, lat)
    selected = p.select(batch, {"a": forked()}, lat)
    assert len(selected["a"]) == 7 and p.filler("a") == 3  # the chain's 4 nodes and 3 side nodes
    admission = SloAdmission()
    admission.tier_of["a"] = 50.0
    step = RequestStep("a", 0, depth=3, width=4, verified=7, filler=p.filler("a"), accepted=2, emitted=3)
    record = IterationRecord(0, requests=[step])
    for _ in range(80):  # a moving average with weight 0.1 on the newest
        admission.observe(record)
    assert admission.stats[50.0].cost == pytest.approx(4.0, abs=0.01)  # what the chain costs, not 7
    p.observe(record)
    assert p.filler("a") == 0  # forgotten once its pass is recorded


def test_joint_drafts_chains_under_slo_pressure():
    """A queue waiting for admission, a request at risk beside others, or one whose chain cannot keep
    its pace: chains only, as priced. A request alone whose chain keeps its pace has trees."""
    lat = cost(FREE)
    calm = [req("a"), req("b")]
    assert {s.width for s in make_policy("joint").shapes(BatchView(calm), lat).values()} == {4}
    queued = BatchView(calm, waiting=3)
    assert {s.width for s in make_policy("joint").shapes(queued, lat).values()} == {1}
    lat.t_spec_ms = 20.0  # the measured iteration: neither request below keeps its pace on its root alone
    kept = req("v", tpot=12.0, decoded=0, elapsed=0.0)  # 12 ms a token: its chain's tokens cover a step
    behind = req("u", tpot=5.0, decoded=0, elapsed=0.0)  # 5 ms a token: not even a chain of 7 at a = 0.6
    shapes = make_policy("joint").shapes(BatchView([kept]), lat)  # alone: trees while its chain keeps pace
    assert shapes["v"].depth > 0 and shapes["v"].width == 4
    shapes = make_policy("joint").shapes(BatchView([behind]), lat)
    assert shapes["u"].depth > 0 and shapes["u"].width == 1
    shapes = make_policy("joint").shapes(BatchView([*calm, kept]), lat)  # beside others, at risk: chains
    assert shapes["v"].depth > 0 and {s.width for s in shapes.values()} == {1}


def test_a_probe_stays_a_chain():
    """Drafting off (k = 0, verification dear): TurboSpec's first probe drafts one token for one request, as a
    chain even where the draft's width is free."""
    p = make_policy("joint")
    lat = cost(DEAR)
    batch = BatchView([req("a")])
    p.control.off_steps[0] = p.control.probe_every  # the next pass at k = 0 probes
    shapes = p.shapes(batch, lat)
    assert p.control.current[0] == 0 and shapes == {"a": Shape(1, 1)}
