"""Speculation policies (specserve.gateway.sched.policy) and the PassCost they read.

References: the AdaServe digest (shared/papers/adaserve.md): eq. 8-9 (§3.4), Algorithm 2 with its
errata (§3.3, §3.5), the Figure 2 example, and the pitfalls of §8. The budget B counts roots and is
reduced by co-scheduled prefill tokens (BatchView.tree_budget).

Expected selections are computed either by hand (in comments) or by small brute-force references
written here that scan every node instead of using heaps.
"""

from __future__ import annotations

import math
import random

import pytest

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.policy import (
    NAMES,
    BatchView,
    CandidateTree,
    Policy,
    RequestView,
    Shape,
    make_policy,
)
from specserve.gateway.sched.policy.adaserve import AdaServe, EqualGreedy, GlobalGreedy
from specserve.gateway.sched.policy.fixed import Chain, ExpansionTree

T_SPEC = 10.0  # every test's PassCost predicts a 10 ms iteration (seeded from the baseline)


# ---------------------------------------------------------------- helpers


def model(budget: int, t_spec: float = T_SPEC) -> PassCost:
    m = PassCost(budget_tokens=budget, baseline_iteration_ms=t_spec)
    assert m.t_spec_ms == t_spec
    return m


def req(rid: str, *, tpot: float = 10.0, decoded: int = 0, elapsed: float = 0.0, remaining: int = 100) -> RequestView:
    return RequestView(rid=rid, tier="t", tpot_ms=tpot, ttft_ms=1000.0, decoded=decoded,
                       decode_elapsed_ms=elapsed, remaining=remaining)


def req_a(rid: str, a: float, *, tpot: float = 10.0, decoded: int = 20, remaining: int = 100) -> RequestView:
    """A request whose A(r) is `a` under T_SPEC (up to float rounding)."""
    r = req(rid, tpot=tpot, decoded=decoded, elapsed=(a + decoded) * tpot - T_SPEC, remaining=remaining)
    assert r.required(T_SPEC) == pytest.approx(a)
    return r


def tree(parents: list[int], probs: list[float]) -> CandidateTree:
    return CandidateTree(tokens=[1000 + v for v in range(len(parents))], parents=parents, path_prob=probs)


def beam_tree(rng: random.Random, d: int, w: int) -> CandidateTree:
    """Like the draft's beam: root + d layers of w nodes, each node's parent in the previous layer,
    path_prob = parent's path_prob * u with u in (0, 1) (so children are strictly below parents)."""
    parents, probs, prev = [-1], [1.0], [0]
    for _ in range(d):
        layer = []
        for _ in range(w):
            p = rng.choice(prev)
            parents.append(p)
            probs.append(probs[p] * rng.uniform(0.001, 0.999))
            layer.append(len(parents) - 1)
        prev = layer
    return CandidateTree(tokens=[rng.randrange(32000) for _ in parents], parents=parents, path_prob=probs)


def best_frontier(t: CandidateTree, chosen: set[int]) -> int | None:
    """Brute force: the best unselected node whose parent is selected, by (f̂ desc, depth asc, id asc)."""
    frontier = [v for v in range(1, len(t.tokens)) if v not in chosen and t.parents[v] in chosen]
    return min(frontier, key=lambda v: (-t.path_prob[v], t.depths[v], v), default=None)


def ref_global(trees: dict[str, CandidateTree], chosen: dict[str, set[int]], budget: int) -> None:
    """Brute-force throughput phase: `budget` times, the best frontier node of the whole batch
    (ties by f̂, depth, then batch position)."""
    for _ in range(budget):
        best = None
        for i, (rid, t) in enumerate(trees.items()):
            v = best_frontier(t, chosen[rid])
            if v is not None:
                key = (-t.path_prob[v], t.depths[v], i, v)
                if best is None or key < best[0]:
                    best = (key, rid, v)
        if best is None:
            return
        chosen[best[1]].add(best[2])


def ref_adaserve(batch: BatchView, trees: dict[str, CandidateTree], m: PassCost, n_max: int) -> dict:
    """Algorithm 2 (errata applied), written out without heaps."""
    chosen = {rid: {0} for rid in trees}
    left = batch.tree_budget(m) - len(trees)
    views = sorted((r for r in batch.requests if r.rid in trees), key=lambda r: -r.required(m.t_spec_ms))
    for r in views:
        t = trees[r.rid]
        target = min(r.required(m.t_spec_ms), max(t.depths) + 1)  # A_cap = min(A, d + 1)
        n_acc, added = 1.0, 0
        while n_acc < target and added < n_max and left > 0:
            v = best_frontier(t, chosen[r.rid])
            if v is None:
                break
            chosen[r.rid].add(v)
            n_acc += t.path_prob[v]
            added += 1
            left -= 1
    ref_global(trees, chosen, left)
    return {rid: sorted(s) for rid, s in chosen.items()}


def greedy_prefix(t: CandidateTree, k: int) -> list[int]:
    """The first k nodes one request's greedy takes (without the root)."""
    chosen: set[int] = {0}
    out = []
    for _ in range(k):
        v = best_frontier(t, chosen)
        if v is None:
            break
        chosen.add(v)
        out.append(v)
    return out


def slo_count(t: CandidateTree, a: float, n_max: int) -> int:
    """How many nodes the SLO phase gives a request with A(r) = a, budget permitting."""
    target, n_acc, k = min(a, max(t.depths) + 1), 1.0, 0
    for v in greedy_prefix(t, len(t.tokens)):
        if not (n_acc < target and k < n_max):
            break
        n_acc += t.path_prob[v]
        k += 1
    return k


def check_selection(sel: dict, trees: dict[str, CandidateTree]) -> None:
    assert set(sel) == set(trees)
    for rid, nodes in sel.items():
        t = trees[rid]
        assert nodes[0] == 0, (rid, nodes)
        assert nodes == sorted(set(nodes)), (rid, nodes)  # sorted, no duplicates
        assert all(0 <= v < len(t.tokens) for v in nodes)
        assert all(t.parents[v] in nodes for v in nodes if v), (rid, nodes)  # parent-closed


# ---------------------------------------------------------------- make_policy


@pytest.mark.parametrize("name, cls, attrs", [
    ("adaserve", AdaServe, {}),
    ("global-greedy", GlobalGreedy, {}),
    ("equal-greedy", EqualGreedy, {}),
    ("chain:1", Chain, {"k": 1, "name": "chain:1"}),
    ("chain:5", Chain, {"k": 5, "name": "chain:5"}),
    ("tree:1,1,3,1,1,1,1,1", ExpansionTree, {"widths": [1, 1, 3, 1, 1, 1, 1, 1], "name": "tree:1,1,3,1,1,1,1,1"}),
    ("tree:2,1", ExpansionTree, {"widths": [2, 1]}),
])
def test_make_policy_builds_the_named_class(name, cls, attrs):
    p = make_policy(name)
    assert type(p) is cls
    assert p.uses_draft
    for k, v in attrs.items():
        assert getattr(p, k) == v


def test_make_policy_none_is_the_base_policy():
    p = make_policy("none")
    assert type(p) is Policy
    assert p.name == "none" and not p.uses_draft


@pytest.mark.parametrize("name", ["adaserve", "global-greedy", "equal-greedy"])
def test_make_policy_passes_the_caps_to_budgeted_policies(name):
    p = make_policy(name, max_depth=3, max_width=2, max_added=5)
    assert (p.name, p.max_depth, p.max_width, p.max_added) == (name, 3, 2, 5)


@pytest.mark.parametrize("name", ["", "foo", "Adaserve", "adaserve:3", "none:1", "global_greedy", "specinfer"])
def test_make_policy_unknown_name_lists_the_names(name):
    with pytest.raises(ValueError) as exc:
        make_policy(name)
    for n in NAMES:
        assert n in str(exc.value)


@pytest.mark.parametrize("name", ["chain:0", "chain:-2", "chain:x", "chain:1.5", "tree:a", "tree:0", "tree:1,,2",
                                  "tree:2,-1"])
def test_make_policy_bad_argument_raises(name):
    with pytest.raises(ValueError, match="policy"):
        make_policy(name)


@pytest.mark.parametrize("name", ["chain:0", "tree:a"])
def test_make_policy_bad_argument_lists_the_names(name):
    with pytest.raises(ValueError) as exc:
        make_policy(name)
    for n in NAMES:
        assert n in str(exc.value)


# ---------------------------------------------------------------- plan: eq. 8-9


BUDGETED = [AdaServe, GlobalGreedy, EqualGreedy]


@pytest.mark.parametrize("cls", BUDGETED)
@pytest.mark.parametrize("budget, n, d_max, w_max, d, w", [
    (8, 2, 3, 2, 3, 2),  # Figure 2: ceil(4) -> 3 by D_max, floor(4) -> 2 by W_max
    (8, 2, 8, 8, 4, 4),  # B/n = 4 exactly
    (10, 3, 8, 4, 4, 3),  # ceil(3.33) = 4, floor = 3
    (7, 6, 8, 4, 2, 1),  # ceil(1.17) = 2, floor = 1
    (13, 4, 8, 8, 4, 3),  # ceil(3.25) = 4, floor = 3
    (582, 64, 8, 4, 8, 4),  # ceil(9.09) = 10 -> 8, floor = 9 -> 4
    (100, 1, 16, 64, 16, 64),  # one request: both capped
    (100, 1, 200, 200, 100, 100),  # one request, no caps: d = w = B
])
def test_plan_eq_8_9(cls, budget, n, d_max, w_max, d, w):
    assert d == max(1, min(d_max, math.ceil(budget / n))) and w == max(1, min(w_max, budget // n))
    pol = cls(max_depth=d_max, max_width=w_max)
    batch = BatchView([req(f"r{i}", remaining=1000) for i in range(n)])
    shapes = pol.shapes(batch, model(budget))
    assert list(shapes) == [f"r{i}" for i in range(n)]
    assert all(s == Shape(d, w) for s in shapes.values())


@pytest.mark.parametrize("cls", BUDGETED)
def test_plan_budget_is_reduced_by_prefill_tokens(cls):
    pol = cls(max_depth=8, max_width=8)
    reqs = [req(f"r{i}") for i in range(4)]
    m = model(40)
    assert BatchView(reqs).tree_budget(m) == 40
    assert list(pol.shapes(BatchView(reqs), m).values()) == [Shape(8, 8)] * 4  # ceil/floor(40/4) = 10 -> 8
    batch = BatchView(reqs, prefill_tokens=26)  # 14 left: ceil(3.5) = 4, floor(3.5) = 3
    assert batch.tree_budget(m) == 14
    assert list(pol.shapes(batch, m).values()) == [Shape(4, 3)] * 4
    batch = BatchView(reqs, prefill_tokens=35)  # 5 left: ceil(1.25) = 2, floor = 1
    assert list(pol.shapes(batch, m).values()) == [Shape(2, 1)] * 4


@pytest.mark.parametrize("cls", BUDGETED)
@pytest.mark.parametrize("budget, prefill, n", [
    (4, 0, 4),  # n == B: the roots use everything
    (3, 0, 5),  # n > B
    (10, 7, 3),  # prefill leaves exactly the roots
    (10, 9, 3),  # prefill leaves less than the roots
    (10, 50, 3),  # prefill above B
])
def test_plan_no_drafting_when_roots_use_the_budget(cls, budget, prefill, n):
    batch = BatchView([req(f"r{i}") for i in range(n)], prefill_tokens=prefill)
    m = model(budget)
    assert batch.tree_budget(m) == n  # never below one root per request
    shapes = cls().shapes(batch, m)
    assert len(shapes) == n and all(s.depth == 0 for s in shapes.values())


@pytest.mark.parametrize("cls", BUDGETED)
def test_plan_one_token_over_the_roots_still_drafts(cls):
    batch = BatchView([req(f"r{i}") for i in range(3)], prefill_tokens=6)
    shapes = cls().shapes(batch, model(10))  # tree budget 4 > n = 3: ceil(4/3) = 2, floor = 1
    assert list(shapes.values()) == [Shape(2, 1)] * 3


@pytest.mark.parametrize("cls", BUDGETED)
def test_plan_depth_capped_at_remaining_minus_one(cls):
    reqs = [req("a", remaining=1), req("b", remaining=2), req("c", remaining=4), req("d", remaining=100)]
    shapes = cls(max_depth=8, max_width=4).shapes(BatchView(reqs), model(100))  # d = min(8, 25) = 8, w = 4
    assert shapes == {"a": Shape(0, 4), "b": Shape(1, 4), "c": Shape(3, 4), "d": Shape(8, 4)}


def test_plan_empty_batch():
    for cls in BUDGETED:
        assert cls().shapes(BatchView([]), model(8)) == {}


# ---------------------------------------------------------------- AdaServe: Figure 2


def figure2():
    """B = 8, n = 2, d = 3, w = 2. Node ids per layer: 1-2 (depth 1), 3-4 (depth 2), 5-6 (depth 3).

    r0 (A = (7 + 10) / 10 - 0 = 1.7):        r1 (A = (9 + 10) / 10 - 0 = 1.9):
      1: 0.7  (root)   2: 0.2  (root)          1: 0.3  (root)   2: 0.5  (root)
      3: 0.6  (1)      4: 0.05 (1)             3: 0.4  (2)      4: 0.28 (1)
      5: 0.32 (3)      6: 0.25 (3)             5: 0.2  (4)      6: 0.35 (3)
    """
    t0 = tree([-1, 0, 0, 1, 1, 3, 3], [1.0, 0.7, 0.2, 0.6, 0.05, 0.32, 0.25])
    t1 = tree([-1, 0, 0, 2, 1, 4, 3], [1.0, 0.3, 0.5, 0.4, 0.28, 0.2, 0.35])
    r0 = req("r0", tpot=10.0, decoded=0, elapsed=7.0)
    r1 = req("r1", tpot=10.0, decoded=0, elapsed=9.0)
    assert r0.required(T_SPEC) == 1.7 and r1.required(T_SPEC) == 1.9
    return BatchView([r0, r1]), {"r0": t0, "r1": t1}


def test_figure2_plan():
    batch, _ = figure2()
    shapes = AdaServe(max_depth=3, max_width=2).shapes(batch, model(8))
    assert shapes == {"r0": Shape(3, 2), "r1": Shape(3, 2)}


def test_figure2_selection():
    # Roots: 8 - 2 = 6 left.
    # SLO phase, A descending: r1 first (A 1.9): frontier {1: .3, 2: .5} -> takes 2 (n_acc 1.5), pushes 3 (.4);
    #   frontier {1: .3, 3: .4} -> takes 3 (n_acc 1.9 = target): stops. r1 = {0, 2, 3}; 4 left.
    # r0 (A 1.7): frontier {1: .7, 2: .2} -> takes 1 (n_acc 1.7 = target): stops. r0 = {0, 1}; 3 left.
    # Throughput phase over the frontiers r0 {2: .2, 3: .6, 4: .05}, r1 {1: .3, 6: .35}:
    #   r0:3 (.6) [pushes r0:5 .32, r0:6 .25], then r1:6 (.35), then r0:5 (.32) beats r1:1 (.3).
    batch, trees = figure2()
    sel = AdaServe(max_depth=3, max_width=2).select(batch, trees, model(8))
    assert sel == {"r0": [0, 1, 3, 5], "r1": [0, 2, 3, 6]}
    assert sel == ref_adaserve(batch, trees, model(8), 16)


@pytest.mark.parametrize("budget, expected", [
    (2, {"r0": [0], "r1": [0]}),  # roots only
    (3, {"r0": [0], "r1": [0, 2]}),  # r1 (most behind) first, runs the budget out
    (4, {"r0": [0], "r1": [0, 2, 3]}),  # r0 gets only its root although its 0.7 beats r1's 0.5, 0.4
    (5, {"r0": [0, 1], "r1": [0, 2, 3]}),  # SLO phase only, nothing left
    (6, {"r0": [0, 1, 3], "r1": [0, 2, 3]}),  # one leftover: r0:3 (.6)
])
def test_figure2_smaller_budgets(budget, expected):
    batch, trees = figure2()
    assert AdaServe(max_depth=3, max_width=2).select(batch, trees, model(budget)) == expected


def test_figure2_budget_counts_prefill():
    batch, trees = figure2()
    batch.prefill_tokens = 3  # 11 - 3 = 8: the same as B = 8
    assert AdaServe(max_depth=3, max_width=2).select(batch, trees, model(11)) == {"r0": [0, 1, 3, 5],
                                                                                  "r1": [0, 2, 3, 6]}


def test_figure2_global_greedy_without_slo_phase():
    # B = 4, 2 left: global-greedy takes r0:1 (.7), r0:3 (.6); AdaServe gives them to r1 (see above).
    batch, trees = figure2()
    assert GlobalGreedy().select(batch, trees, model(4)) == {"r0": [0, 1, 3], "r1": [0]}


# ---------------------------------------------------------------- AdaServe: SLO phase details


def urgent_and_ok(a_ok: float):
    """'ok' has a high-probability tree but A <= 1; 'urgent' (A = 2.5) has a poorer one.
    urgent: greedy 0.6 (1.6), 0.5 (2.1), 0.45 (2.55 >= 2.5): 3 nodes."""
    ok = tree([-1, 0, 0, 1, 1], [1.0, 0.95, 0.9, 0.85, 0.8])
    urgent = tree([-1, 0, 0, 1, 2], [1.0, 0.6, 0.5, 0.45, 0.1])
    batch = BatchView([req_a("ok", a_ok), req_a("urgent", 2.5)])
    return batch, {"ok": ok, "urgent": urgent}


@pytest.mark.parametrize("a_ok", [1.0, 0.999, 0.3, 0.0, -4.0])
def test_on_schedule_request_gets_nothing_in_slo_phase(a_ok):
    batch, trees = urgent_and_ok(a_ok)
    m = model(2 + 3)  # global phase budget 0: roots + the urgent request's 3 nodes
    assert AdaServe().select(batch, trees, m) == {"ok": [0], "urgent": [0, 1, 2, 3]}
    # global-greedy, blind to SLOs, gives everything to the better tree
    assert GlobalGreedy().select(batch, trees, m) == {"ok": [0, 1, 2, 3], "urgent": [0]}
    # one more slot goes to the global phase: the best frontier node is ok:1 (.95)
    assert AdaServe().select(batch, trees, model(6)) == {"ok": [0, 1], "urgent": [0, 1, 2, 3]}


def test_slo_phase_serves_most_behind_first_regardless_of_batch_order():
    t = tree([-1, 0, 0, 1, 2], [1.0, 0.6, 0.5, 0.3, 0.2])  # same tree for both
    for order in (["lo", "hi"], ["hi", "lo"]):
        views = {"lo": req_a("lo", 2.0), "hi": req_a("hi", 3.0)}
        batch = BatchView([views[r] for r in order])
        # hi: .6 (1.6), .5 (2.1), .3 (2.4), .2 (2.6): frontier empties before 3.0; 4 nodes, budget 6 - 2 = 4
        sel = AdaServe().select(batch, {r: t for r in order}, model(6))
        assert sel == {"hi": [0, 1, 2, 3, 4], "lo": [0]}
        # 2 more: lo takes .6 (1.6), .5 (2.1 >= 2.0)
        sel = AdaServe().select(batch, {r: t for r in order}, model(8))
        assert sel == {"hi": [0, 1, 2, 3, 4], "lo": [0, 1, 2]}


def test_slo_ties_keep_admission_order():
    t = tree([-1, 0], [1.0, 0.5])
    batch = BatchView([req_a("x", 1.5, tpot=10.0), req_a("y", 1.5, tpot=10.0)])
    assert batch.requests[0].required(T_SPEC) == batch.requests[1].required(T_SPEC)
    assert AdaServe().select(batch, {"x": t, "y": t}, model(3)) == {"x": [0, 1], "y": [0]}
    batch.requests.reverse()
    assert AdaServe().select(batch, {"y": t, "x": t}, model(3)) == {"y": [0, 1], "x": [0]}


def test_n_max_caps_the_slo_phase():
    hopeless = tree([-1, 0, 0, 1, 2, 3, 4], [1.0, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05])
    other = tree([-1, 0, 0], [1.0, 0.04, 0.03])  # A = 1.05: needs both nodes (1.04 < 1.05 <= 1.07)
    batch = BatchView([req_a("hopeless", 50.0), req_a("other", 1.05)])
    trees = {"hopeless": hopeless, "other": other}
    m = model(2 + 2 + 2)  # global budget 0 when hopeless is capped at 2
    assert AdaServe(max_added=2).select(batch, trees, m) == {"hopeless": [0, 1, 2], "other": [0, 1, 2]}
    assert AdaServe(max_added=3).select(batch, trees, m) == {"hopeless": [0, 1, 2, 3], "other": [0, 1]}
    # without a binding cap the hopeless request takes the whole budget (A_cap = 4 > its mass 2.55)
    assert AdaServe(max_added=16).select(batch, trees, m) == {"hopeless": [0, 1, 2, 3, 4], "other": [0]}
    # with room, the global phase gives the rest to the best frontier nodes: hopeless .3, .2
    sel = AdaServe(max_added=2).select(batch, trees, model(8))
    assert sel == {"hopeless": [0, 1, 2, 3, 4], "other": [0, 1, 2]}


def test_a_cap_is_depth_plus_one():
    # x: A = 10 but depth 2, so the target is 3: greedy .9 (1.9), .9 (2.8), .85 (3.65 >= 3): 3 of its 4 nodes.
    x = tree([-1, 0, 0, 1, 2], [1.0, 0.9, 0.9, 0.85, 0.8])
    y = tree([-1, 0, 0], [1.0, 0.6, 0.1])  # A = 1.5: one node
    batch = BatchView([req_a("x", 10.0), req_a("y", 1.5)])
    sel = AdaServe().select(batch, {"x": x, "y": y}, model(2 + 3 + 1))
    assert sel == {"x": [0, 1, 2, 3], "y": [0, 1]}


def test_root_only_trees():
    batch = BatchView([req_a("a", 5.0), req_a("b", 0.5)])
    trees = {"a": CandidateTree.root_only(7), "b": tree([-1, 0], [1.0, 0.3])}
    for pol in (AdaServe(), GlobalGreedy(), EqualGreedy()):
        assert pol.select(batch, trees, model(10)) == {"a": [0], "b": [0, 1]}


def test_ties_break_by_depth_then_batch_position():
    # f̂ can saturate (fp16): a child may equal its parent. Keys are (f̂ desc, depth asc, batch position, id).
    a = tree([-1, 0, 1], [1.0, 0.5, 0.5])
    b = tree([-1, 0], [1.0, 0.5])
    batch = BatchView([req("a"), req("b")])
    for pol in (GlobalGreedy(), AdaServe()):  # A <= 0 for both: AdaServe is global-only here
        assert pol.select(batch, {"a": a, "b": b}, model(3)) == {"a": [0, 1], "b": [0]}
        assert pol.select(batch, {"b": b, "a": a}, model(3)) == {"b": [0, 1], "a": [0]}
        assert pol.select(batch, {"a": a, "b": b}, model(4)) == {"a": [0, 1], "b": [0, 1]}  # b:1 is shallower
        assert pol.select(batch, {"a": a, "b": b}, model(5)) == {"a": [0, 1, 2], "b": [0, 1]}
    # within one request: parent before child, then shallower first
    c = tree([-1, 0, 1, 0], [1.0, 0.5, 0.5, 0.5])
    one = BatchView([req("c")])
    assert GlobalGreedy().select(one, {"c": c}, model(3)) == {"c": [0, 1, 3]}
    assert EqualGreedy().select(one, {"c": c}, model(3)) == {"c": [0, 1, 3]}


# ---------------------------------------------------------------- random invariants


def random_case(rng: random.Random):
    n = rng.randint(1, 5)
    reqs, trees = [], {}
    for i in range(n):
        rid = f"q{i}"
        tpot = rng.uniform(5.0, 50.0)
        decoded = rng.randint(0, 40)
        a = rng.uniform(-1.0, 7.0)
        reqs.append(RequestView(rid, "t", tpot, 1000.0, decoded, (a + decoded) * tpot - T_SPEC, 100))
        trees[rid] = beam_tree(rng, rng.randint(0, 4), rng.randint(1, 3))
    total = sum(len(t.tokens) for t in trees.values())
    budget = rng.randint(1, total + 4)
    prefill = rng.choice([0, 0, rng.randint(0, budget)])
    return BatchView(reqs, prefill_tokens=prefill), trees, model(budget + prefill)


CASES = 250


def test_random_selection_invariants():
    rng = random.Random(1234)
    full = {"adaserve": 0, "global-greedy": 0}
    for _ in range(CASES):
        batch, trees, m = random_case(rng)
        n = len(trees)
        cap = batch.tree_budget(m)
        assert cap == max(n, m.budget_tokens - batch.prefill_tokens)
        n_max = rng.randint(1, 8)
        available = sum(len(t.tokens) for t in trees.values())
        for pol in (AdaServe(max_added=n_max), GlobalGreedy(), EqualGreedy()):
            sel = pol.select(batch, trees, m)
            check_selection(sel, trees)
            used = sum(len(s) for s in sel.values())
            assert used <= max(n, cap), (pol.name, used, cap)
            if pol.name in full:
                assert used == min(cap, available), (pol.name, used, cap, available)
                full[pol.name] += cap < available
    assert min(full.values()) > CASES // 4  # the budget, not the candidates, bound many cases


def test_random_global_greedy_is_top_nodes_by_path_prob():
    rng = random.Random(99)
    for _ in range(CASES):
        batch, trees, m = random_case(rng)
        sel = GlobalGreedy().select(batch, trees, m)
        chosen = {rid: {0} for rid in trees}
        ref_global(trees, chosen, batch.tree_budget(m) - len(trees))
        assert sel == {rid: sorted(s) for rid, s in chosen.items()}
        # children are strictly below their parents, so the greedy union is the global top-(B - n) non-roots
        k = batch.tree_budget(m) - len(trees)
        ranked = sorted(((-t.path_prob[v], rid, v) for rid, t in trees.items() for v in range(1, len(t.tokens))))
        top = {(rid, v) for _, rid, v in ranked[:k]}
        assert {(rid, v) for rid, s in sel.items() for v in s if v} == top


def test_random_adaserve_matches_reference():
    rng = random.Random(7)
    for _ in range(CASES):
        batch, trees, m = random_case(rng)
        n_max = rng.randint(1, 8)
        assert AdaServe(max_added=n_max).select(batch, trees, m) == ref_adaserve(batch, trees, m, n_max)


def test_random_equal_greedy_shares():
    rng = random.Random(5)
    for _ in range(CASES):
        batch, trees, m = random_case(rng)
        n = len(trees)
        share = (batch.tree_budget(m) - n) // n
        sel = EqualGreedy().select(batch, trees, m)
        for rid, t in trees.items():
            assert len(sel[rid]) - 1 == min(share, len(t.tokens) - 1)
            assert sel[rid] == sorted([0] + greedy_prefix(t, share))


def test_equal_greedy_each_gets_floor_share():
    rng = random.Random(3)
    trees = {f"q{i}": beam_tree(rng, 3, 3) for i in range(3)}  # 9 non-root nodes each
    batch = BatchView([req(rid) for rid in trees])
    for budget, share in [(3, 0), (5, 0), (6, 1), (20, 5), (22, 6), (30, 9), (40, 9)]:
        sel = EqualGreedy().select(batch, trees, model(budget))
        assert [len(s) - 1 for s in sel.values()] == [share] * 3, budget


def test_random_slo_phase_higher_a_gets_at_least_as_many():
    rng = random.Random(11)
    strict = 0
    for _ in range(CASES):
        t = beam_tree(rng, rng.randint(1, 4), rng.randint(1, 3))
        decoded, elapsed = rng.randint(0, 30), rng.uniform(0.0, 500.0)
        tpot_hi = (elapsed + T_SPEC) / (decoded + rng.uniform(0.5, 6.0))  # A_hi in (0.5, 6)
        lo = req("lo", tpot=tpot_hi * rng.uniform(1.0001, 1.6), decoded=decoded, elapsed=elapsed)
        hi = req("hi", tpot=tpot_hi, decoded=decoded, elapsed=elapsed)
        a_lo, a_hi = lo.required(T_SPEC), hi.required(T_SPEC)
        assert a_hi > a_lo
        n_max = rng.randint(1, 10)
        k_lo, k_hi = slo_count(t, a_lo, n_max), slo_count(t, a_hi, n_max)
        batch = BatchView([lo, hi])  # the less urgent one first: the sort, not the order, must decide
        sel = AdaServe(max_added=n_max).select(batch, {"lo": t, "hi": t}, model(2 + k_lo + k_hi))  # global: 0
        assert sel == {"hi": sorted([0] + greedy_prefix(t, k_hi)), "lo": sorted([0] + greedy_prefix(t, k_lo))}
        assert len(sel["hi"]) >= len(sel["lo"])
        strict += len(sel["hi"]) > len(sel["lo"])
        if k_hi:  # one slot short: the more urgent request is served first, the other gets its root only
            sel = AdaServe(max_added=n_max).select(batch, {"lo": t, "hi": t}, model(2 + k_hi))
            assert sel["lo"] == [0] and len(sel["hi"]) == k_hi + 1
    assert strict > CASES // 4


# ---------------------------------------------------------------- CandidateTree


def test_candidate_tree_derives_depths_and_children():
    t = tree([-1, 0, 0, 1, 1, 2, 3], [1.0, 0.6, 0.3, 0.4, 0.1, 0.2, 0.3])
    assert t.depths == [0, 1, 1, 2, 2, 2, 3]
    assert t.children == [[1, 2], [3, 4], [5], [6], [], [], []]
    r = CandidateTree.root_only(42)
    assert (r.tokens, r.parents, r.path_prob, r.depths, r.children) == ([42], [-1], [1.0], [0], [[]])


def test_candidate_tree_subtree_reindexes_parents():
    t = tree([-1, 0, 0, 1, 1, 2, 3], [1.0, 0.6, 0.3, 0.4, 0.1, 0.2, 0.3])
    assert t.subtree([0]) == ([1000], [-1])
    assert t.subtree(list(range(7))) == ([1000 + v for v in range(7)], [-1, 0, 0, 1, 1, 2, 3])
    # nodes 0, 1, 2, 3, 5, 6 -> positions 0..5; 5's parent 2 -> 2, 6's parent 3 -> 3
    assert t.subtree([6, 0, 5, 3, 2, 1]) == ([1000, 1001, 1002, 1003, 1005, 1006], [-1, 0, 0, 1, 2, 3])
    # nodes 0, 2, 5: 5's parent 2 is at position 1
    assert t.subtree([0, 2, 5]) == ([1000, 1002, 1005], [-1, 0, 1])
    assert t.subtree([5, 2, 0]) == ([1000, 1002, 1005], [-1, 0, 1])


def test_random_subtree_of_selection_is_consistent():
    rng = random.Random(21)
    for _ in range(50):
        batch, trees, m = random_case(rng)
        for rid, nodes in AdaServe().select(batch, trees, m).items():
            toks, parents = trees[rid].subtree(nodes)
            assert toks == [trees[rid].tokens[v] for v in nodes]
            assert parents == [nodes.index(trees[rid].parents[v]) if v else -1 for v in nodes]
            assert all(-1 <= p < i for i, p in enumerate(parents))


# ---------------------------------------------------------------- fixed policies


def test_chain_plan_and_select_all():
    pol = Chain(3)
    batch = BatchView([req("a", remaining=100), req("b", remaining=2), req("c", remaining=1)])
    assert pol.shapes(batch, model(8)) == {"a": Shape(3, 1), "b": Shape(1, 1), "c": Shape(0, 1)}
    trees = {"a": tree([-1, 0, 1, 2], [1.0, 0.5, 0.2, 0.01]), "b": tree([-1, 0], [1.0, 0.1]),
             "c": CandidateTree.root_only(5)}
    # budget-blind: everything is verified even when B is smaller
    assert pol.select(batch, trees, model(2)) == {"a": [0, 1, 2, 3], "b": [0, 1], "c": [0]}


def test_expansion_tree_plan():
    pol = make_policy("tree:1,1,3,1,1,1,1,1")
    batch = BatchView([req("a"), req("b", remaining=4)])
    assert pol.shapes(batch, model(8)) == {"a": Shape(8, 3), "b": Shape(3, 3)}


def test_expansion_tree_hand_example():
    # root -> 1 (.5), 2 (.3), 3 (.1); 1 -> 4 (.4), 5 (.2); 2 -> 6 (.25), 7 (.29); 3 -> 8 (.09); 4 -> 9 (.3)
    t = tree([-1, 0, 0, 0, 1, 1, 2, 2, 3, 4], [1.0, 0.5, 0.3, 0.1, 0.4, 0.2, 0.25, 0.29, 0.09, 0.3])
    batch = BatchView([req("a")])
    # widths 2, 1: root's best two children 1, 2; then each one's best child: 4 (.4) and 7 (.29); depth 3 cut
    assert ExpansionTree([2, 1]).select(batch, {"a": t}, model(8)) == {"a": [0, 1, 2, 4, 7]}
    assert ExpansionTree([1]).select(batch, {"a": t}, model(8)) == {"a": [0, 1]}
    assert ExpansionTree([5, 5, 5]).select(batch, {"a": t}, model(8)) == {"a": list(range(10))}


def full_specinfer_beam() -> CandidateTree:
    """Width-3 beam of depth 8 whose full ⟨1,1,3,1,1,1,1,1⟩ expansion exists: 20 draft nodes."""
    parents, probs = [-1], [1.0]

    def add(p: int, f: float) -> int:
        parents.append(p)
        probs.append(probs[p] * f)
        return len(parents) - 1

    layer1 = [add(0, 0.5), add(0, 0.3), add(0, 0.2)]
    layer2 = [add(layer1[0], 0.9), add(layer1[1], 0.5), add(layer1[0], 0.05)]
    a = layer2[0]
    layer = [add(a, 0.5), add(a, 0.3), add(a, 0.2)]
    for _ in range(5):
        layer = [add(v, f) for v, f in zip(layer, (0.9, 0.8, 0.7))]
    return CandidateTree(tokens=list(range(len(parents))), parents=parents, path_prob=probs)


def check_expansion(sel: list[int], t: CandidateTree, widths: list[int]) -> None:
    assert sel[0] == 0 and sel == sorted(set(sel))
    s = set(sel)
    for v in sel:
        kids = [c for c in t.children[v] if c in s]
        lvl = t.depths[v]
        k = widths[lvl] if lvl < len(widths) else 0
        best = sorted(t.children[v], key=lambda c: (-t.path_prob[c], c))[:k]
        assert sorted(kids) == sorted(best), (v, kids, best)
        assert len(kids) <= k
    assert all(t.parents[v] in s for v in sel if v)


def test_expansion_tree_specinfer_shape():
    widths = [1, 1, 3, 1, 1, 1, 1, 1]
    pol = make_policy("tree:1,1,3,1,1,1,1,1")
    batch = BatchView([req("a")])
    t = full_specinfer_beam()
    sel = pol.select(batch, {"a": t}, model(8))["a"]
    check_expansion(sel, t, widths)
    assert len(sel) - 1 == 20
    assert sel == [0, 1, 4, 7, 8, 9] + list(range(10, 25))
    rng = random.Random(8)
    for _ in range(100):
        t = beam_tree(rng, rng.randint(0, 10), rng.randint(1, 4))
        sel = pol.select(batch, {"a": t}, model(8))["a"]
        check_expansion(sel, t, widths)
        assert len(sel) - 1 <= 20


# ---------------------------------------------------------------- Policy (none)


def test_none_policy():
    pol = Policy()
    batch = BatchView([req("a"), req("b", remaining=1)])
    assert pol.shapes(batch, model(100)) == {"a": Shape(0, 1), "b": Shape(0, 1)}
    trees = {"a": tree([-1, 0, 1], [1.0, 0.9, 0.8]), "b": CandidateTree.root_only(3)}
    assert pol.select(batch, trees, model(100)) == {"a": [0], "b": [0]}
    assert pol.describe() == {"name": "none"}


