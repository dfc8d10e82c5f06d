"""The seed papers' policies: TETRIS (selection), TurboSpec (goodput model, MLE acceptance, controller)
`slo-goodput` (their combination with AdaServe's selection) and `joint` (TurboSpec's chains for the
requests at risk of their SLO).

References: the digests in the shared papers folder (tetris.md corrected Algorithm 1 and pitfalls;
turbospec.md eq. 3-4, §3, §8 and pitfalls; adaserve.md pitfalls). Expected values are computed by
hand in comments, or by brute force written here.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from specserve.gateway.perf.cost import OnlineLinear, PassCost
from specserve.gateway.perf.record import DraftStep, IterationRecord, ReplicaStep, RequestStep
from specserve.gateway.sched.plan import TTFT_RESERVE
from specserve.gateway.sched.policy import BatchView, CandidateTree, RequestView, Shape, make_policy
from specserve.gateway.sched.policy.goodput import Acceptance, best_depth, expected_tokens
from specserve.gateway.sched.policy.joint import AT_RISK, LOST, SLACK, Joint, makes_late
from specserve.gateway.sched.policy.slo_goodput import SloGoodput, hopeless
from specserve.gateway.sched.policy.tetris import Tetris, tetris_select
from specserve.gateway.sched.policy.turbospec import FAR_PROBES, HOLD_STEPS, GoodputControl, TurboSpec

# A target whose profiled pass takes 6 + 0.5 ms per token (collinear points: the fit is exact).
CURVE = [(8, 10.0), (16, 14.0), (32, 22.0)]


def latency(budget: int = 32, baseline: float = 10.0, curve=CURVE) -> PassCost:
    return PassCost(budget_tokens=budget, baseline_iteration_ms=baseline, curve=list(curve))


def req(rid: str, *, tpot: float = 50.0, decoded: int = 10, elapsed: float = 100.0, remaining: int = 100,
        lag: int = 0) -> RequestView:
    return RequestView(rid=rid, tier="t", tpot_ms=tpot, ttft_ms=1000.0, decoded=decoded, decode_elapsed_ms=elapsed,
                       remaining=remaining, draft_lag=lag)


def chain(probs: list[float]) -> CandidateTree:
    """A chain candidate with conditional draft probabilities `probs` (path_prob is their running product)."""
    path, p = [1.0], 1.0
    for q in probs:
        p *= q
        path.append(p)
    n = len(path)
    return CandidateTree(tokens=list(range(100, 100 + n)), parents=[-1] + list(range(n - 1)), path_prob=path)


# ---------------------------------------------------------------- TETRIS


def cumulative(probs: list[float]) -> list[float]:
    out, p = [], 1.0
    for q in probs:
        p *= q
        out.append(p)
    return out


def brute_force(rows: list[list[float]], capacity: int) -> tuple[float, int]:
    """max sum_i sum_{j<=k_i} P_ij over 0 <= k_i <= K_i with sum k_i = min(C, sum K_i): (value, tokens)."""
    total = min(capacity, sum(len(r) for r in rows))
    best = -1.0
    for ks in itertools.product(*[range(len(r) + 1) for r in rows]):
        if sum(ks) == total:
            best = max(best, sum(sum(r[:k]) for r, k in zip(rows, ks, strict=True)))
    return best, total


def test_tetris_equals_brute_force_on_random_instances():
    rng = random.Random(19)
    # dyadic probabilities: sums are exact in binary floating point, and ties are frequent (fp16 saturates at 1)
    for _ in range(400):
        rows = [cumulative([rng.choice([1.0, 0.5, 0.25, 0.75]) for _ in range(rng.randint(0, 4))])
                for _ in range(rng.randint(1, 4))]
        capacity = rng.randint(0, sum(len(r) for r in rows) + 2)  # beyond sum K_i: heap exhaustion
        z = tetris_select(rows, capacity)
        value, tokens = brute_force(rows, capacity)
        assert sum(z) == tokens, (rows, capacity, z)
        assert all(0 <= zi <= len(r) for zi, r in zip(z, rows, strict=True))
        assert sum(sum(r[:zi]) for r, zi in zip(rows, z, strict=True)) == value, (rows, capacity, z)


def test_tetris_ties_break_by_position_then_row():
    rows = [[1.0, 1.0], [1.0, 1.0], [1.0]]
    # all P = 1: (j asc, i asc) takes (0,1), (1,1), (2,1), then (0,2)
    assert tetris_select(rows, 3) == [1, 1, 1]
    assert tetris_select(rows, 4) == [2, 1, 1]
    assert tetris_select(rows, 0) == [0, 0, 0]


def test_tetris_capacity_exhaustion_and_empty_rows():
    assert tetris_select([[0.9, 0.8], [], [0.5]], 10) == [2, 0, 1]  # sum K_i < C: stop, do not pad
    assert tetris_select([[0.9, 0.1], [0.5, 0.4]], 2) == [1, 1]  # 0.9, 0.5 beat 0.4 and 0.1 (cumulative)
    assert tetris_select([], 5) == []


def test_tetris_policy_shapes_and_capacity_off_by_n():
    p = make_policy("tetris:2,1")
    assert isinstance(p, Tetris)
    reqs = [req("a"), req("b"), req("c", remaining=2)]
    b = BatchView(reqs)
    assert p.shapes(b, latency()) == {"a": Shape(3, 1), "b": Shape(3, 1), "c": Shape(1, 1)}  # k + e, capped
    # C = min(N k, B - N): B = 32 roots included -> 29 draft tokens, but N k = 6 caps it
    assert p.capacity(b, latency(32), 3) == 6
    assert p.capacity(b, latency(8), 3) == 5  # B = 8 -> C = 8 - 3 (not 8: the off-by-N)
    trees = {"a": chain([0.9, 0.9, 0.9]), "b": chain([0.3, 0.9, 0.9]), "c": chain([0.95])}
    sel = p.select(b, trees, latency(32))
    # cumulative: a 0.9 .81 .729; b .3 .27 .243; c .95 -> top 6: .95 .9 .81 .729 .3 .27
    assert sel == {"a": [0, 1, 2, 3], "b": [0, 1, 2], "c": [0, 1]}
    assert p.select(b, trees, latency(5)) == {"a": [0, 1], "b": [0], "c": [0, 1]}  # C = 2


# ---------------------------------------------------------------- TurboSpec: the goodput model


def test_expected_tokens_formula():
    assert expected_tokens(0.6, 0) == 1.0
    assert expected_tokens(0.6, 2) == pytest.approx(1 + 0.6 + 0.36)  # (1 - .6^3) / .4 = 1.96
    assert expected_tokens(0.7, 2) == pytest.approx(0.3 * 1 + 0.21 * 2 + 0.49 * 3)  # the digest's 1/2/3-token example
    assert expected_tokens(1.0, 4) == 5.0  # the a -> 1 limit


def test_goodput_hand_computed():
    sm = latency(baseline=10.0)
    # nothing timed yet: the baseline at 8 tokens, the curve's slope 0.5 around it (the line 6 + 0.5 t);
    # draft prior: 0.5 + 1.5 d + (1.5 / 16) d n w + 0.05 lag
    assert sm.target_ms(6) == pytest.approx(9.0)
    assert sm.draft_ms(2, 2, 1, 0) == pytest.approx(0.5 + 3.0 + 0.375)
    sm.r_t, sm.r_d, sm.gateway = 1.0, 0.5, 2.0
    # k = 0 over 2 requests: 1 + (6 + 0.5 * 2) + 2 = 10 ms, no draft call
    assert sm.iteration_ms(2, 0, 2) == pytest.approx(10.0)
    # k = 2: target 6 + 0.5 * 6 = 9, draft 3.875 + R_d 0.5 -> 1 + 9 + 2 + 4.375 = 16.375 ms
    assert sm.iteration_ms(6, 2, 2, 1) == pytest.approx(16.375)
    p = TurboSpec()
    b = BatchView([req("a"), req("b")])
    spec = b.requests
    # a = 0.6 (the prior): G(0) = 2 / 10; G(2) = 2 * 1.96 / 16.375
    assert p.control.goodput(b, sm, spec, 0) == pytest.approx(0.2)
    assert p.control.goodput(b, sm, spec, 2) == pytest.approx(3.92 / 16.375)
    # prefill tokens in the same pass count in the target's tokens: k = 0 -> 1 + (6 + 0.5 * 12) + 2
    assert p.control.goodput(BatchView(spec, prefill_tokens=10), sm, spec, 0) == pytest.approx(2 / 15)
    # a draft lag is caught up in the call: +0.05 ms per token
    lagged = [req("a", lag=20), req("b")]
    assert p.control.goodput(BatchView(lagged), sm, lagged, 2) == pytest.approx(3.92 / 17.375)


def test_best_depth_keeps_current_within_margin():
    g = {0: 1.0, 1: 1.02, 2: 1.01}
    assert best_depth(g, 0, 0.03) == 0  # +2% is inside the margin
    assert best_depth(g, 0, 0.01) == 1
    assert best_depth({0: 1.0, 1: 1.2}, 0, 0.03) == 1
    assert best_depth({0: 1.0, 1: 1.0}, 5, 0.03) == 0  # the current is not a choice: the best, ties to smaller


def simulate_chain(rng: random.Random, a: float, k: int) -> int:
    m = 0
    while m < k and rng.random() < a:
        m += 1
    return m


@pytest.mark.parametrize("truth", [0.3, 0.6, 0.85])
def test_mle_acceptance_recovers_the_truth_where_accepted_over_proposed_is_biased(truth):
    rng = random.Random(7)
    est = Acceptance(decay=1.0, prior_weight=0.0)
    accepted = proposed = 0
    for _ in range(20000):
        k = rng.randint(1, 7)
        m = simulate_chain(rng, truth, k)
        est.observe("r", k, m)
        accepted, proposed = accepted + m, proposed + k
    assert est.rate == pytest.approx(truth, abs=0.01)
    assert accepted / proposed < truth - 0.05  # the naive ratio is biased low


def test_the_rates_a_plan_prices_with_are_each_requests_own():
    """`Acceptance.rates` (computed once per plan) equals `rate_of`, and a goodput priced with them equals
    one priced without."""
    rng = random.Random(2)
    p = TurboSpec()
    reqs = [req(f"r{i}", remaining=rng.randint(1, 9), lag=rng.randint(0, 4)) for i in range(12)]
    for r in reqs[:9]:
        for _ in range(rng.randint(1, 5)):
            p.control.acceptance.observe(r.rid, 4, rng.randint(0, 4))
    rates = p.control.acceptance.rates(reqs)
    assert rates == {r.rid: p.control.acceptance.rate_of(r.rid) for r in reqs}
    assert len(set(rates.values())) > 3  # requests with their own counts differ from the global rate
    b, sm = BatchView(reqs), latency()
    for k in range(8):
        assert p.control.goodput(b, sm, reqs[2:], k, rates) == p.control.goodput(b, sm, reqs[2:], k)


def test_the_depth_table_prices_every_k_as_each_k_alone():
    """`GoodputControl.depth_table` (one pass over the requests, grouped by rate and longest chain) gives every
    k's tokens and pass time as `tokens_ms` does for that k alone: requests that share a rate, ones whose output
    ends before k (one with a single token left drafts nothing), draft lags, prompt tokens and KV in the pass."""
    rng = random.Random(5)
    p = TurboSpec()
    reqs = [req(f"r{i}", remaining=rng.choice([1, 2, 3, 5, 9, 40]), lag=rng.choice([0, 0, 3, 17])) for i in range(20)]
    for r in reqs[:6]:
        p.control.acceptance.observe(r.rid, 4, rng.randint(0, 4))
    sm = latency()
    sm.r_t, sm.r_d, sm.gateway = 1.0, 0.5, 2.0
    for batch, spec in ((BatchView(reqs), reqs), (BatchView(reqs, prefill_tokens=30, kv_blocks=9), reqs[3:]),
                        (BatchView(reqs[:1]), reqs[:1]), (BatchView(reqs), [])):
        table = p.control.depth_table(batch, sm, spec)
        assert len(table) == p.control.max_k + 1
        for k, (tokens, t) in enumerate(table):
            alone = p.control.tokens_ms(batch, sm, spec, k)
            assert tokens == pytest.approx(alone[0], rel=1e-12) and t == pytest.approx(alone[1], rel=1e-12)
    assert table[0][1] < p.control.depth_table(BatchView(reqs), sm, reqs)[3][1]  # the draft call is priced


def test_acceptance_per_request_is_shrunk_toward_the_global_rate():
    rng = random.Random(3)
    est = Acceptance(decay=1.0)
    for _ in range(3000):
        for rid, a in (("easy", 0.9), ("hard", 0.2)):
            est.observe(rid, 4, simulate_chain(rng, a, 4))
    assert est.rate_of("easy") == pytest.approx(0.9, abs=0.03)
    assert est.rate_of("hard") == pytest.approx(0.2, abs=0.03)
    assert est.rate_of("new") == est.rate  # no data: the global rate
    est.forget({"easy"})
    assert "hard" not in est.per_request


def test_online_linear_fits_and_forgets():
    f = OnlineLinear([0.0, 0.0], prior_weight=0.01, decay=0.9)
    for t in range(1, 60):
        f.observe([1.0, float(t % 7)], 3.0 + 2.0 * (t % 7))
    assert f.theta == pytest.approx([3.0, 2.0], abs=0.05)
    for t in range(60):
        f.observe([1.0, float(t % 7)], 1.0 + 1.0 * (t % 7))  # the workload shifted
    assert f.theta == pytest.approx([1.0, 1.0], abs=0.05)


def iteration(step: int, *, nodes: int, target_ms: float, spec: int = 0, draft_ms: float = 0.0,
              steps: list[RequestStep] | None = None) -> IterationRecord:
    r = IterationRecord(step, requests=steps or [])
    r.replicas = [ReplicaStep(0, tree_nodes=nodes, call_ms=target_ms + 1, service_ms=target_ms)]
    if spec:
        r.draft = DraftStep(requests=spec, call_ms=draft_ms + 0.5, service_ms=draft_ms)
    r.target_phase_ms = target_ms + 1
    r.total_ms = r.target_phase_ms + r.draft.call_ms + 1
    return r


def test_turbospec_turns_off_when_the_batch_is_large_and_on_when_small():
    p = TurboSpec()
    small = BatchView([req("a")])
    k_small = p.shapes(small, latency(curve=[(1, 10.0), (64, 11.0)]))["a"].depth  # verification nearly free
    assert k_small >= 2  # a = 0.6 (prior), draft 1.5 ms a step: l(.6, 2) / 13.7 ms beats k = 1 and 3
    big = BatchView([req(f"r{i}") for i in range(64)])
    p2 = TurboSpec()
    shapes = p2.shapes(big, latency(curve=[(8, 10.0), (64, 38.0)]))  # 0.5 ms per verified token
    assert all(s.depth == 0 for s in shapes.values())  # off: no draft call at all
    assert p2.control.thr == 64  # later arrivals at this load skip their draft prefill


@pytest.mark.parametrize("cls", [TurboSpec, Joint])
def test_an_off_far_from_paying_is_held_unpriced_for_a_few_steps(cls, monkeypatch):
    """k = 0 chosen with every k > 0 under half its goodput is kept for HOLD_STEPS iterations without pricing the
    depths; a batch shrunk below HOLD_BATCH of the size priced, an observed drafted step, or (joint) a request at
    risk prices at once. The held choice is the one pricing would make."""
    priced: list[int] = []
    table = GoodputControl.depth_table
    monkeypatch.setattr(GoodputControl, "depth_table", lambda self, b, *a: priced.append(len(b.requests)) or
                        table(self, b, *a))
    p = cls(probe_every=1000)
    lat = latency(curve=[(8, 10.0), (64, 38.0)])
    lat.draft.theta = [100.0, 10.0, 0.5, 0.0]  # a draft call costs more than the pass: far from paying
    big = [req(f"r{i}", tpot=1000.0) for i in range(64)]
    for _ in range(1 + HOLD_STEPS):
        assert all(s.depth == 0 for s in p.shapes(BatchView(big), lat).values())
    assert len(priced) == 1 and p.control.thr == 64  # priced once; the skip threshold as when priced
    p.shapes(BatchView(big), lat)
    assert len(priced) == 2  # held HOLD_STEPS, then priced again
    p.shapes(BatchView(big[:40]), lat)
    assert len(priced) == 3  # 40 < 0.75 * 64: priced at once
    p.control.proposed["r0"] = 2
    p.observe(iteration(0, nodes=66, target_ms=38.0, steps=[RequestStep("r0", 0, depth=2, verified=3, accepted=1,
                                                                        emitted=2)]))
    p.shapes(BatchView(big[:40]), lat)
    assert len(priced) == 4  # an acceptance measured: priced again
    unpriced = TurboSpec(probe_every=1000)
    assert p.shapes(BatchView(big[:40]), lat) == unpriced.shapes(BatchView(big[:40]), lat)
    if cls is Joint:
        assert len(priced) == 5
        lat.t_spec_ms = 13.5
        urgent = req("u", tpot=12.0, decoded=20, elapsed=230.0)  # its root alone falls behind its pace
        p.shapes(BatchView([*big[:39], urgent]), lat)
        assert len(priced) == 7  # priced: its wide and narrow options (the unpriced policy above priced the fifth)


def test_turbospec_learns_the_draft_cost_online_and_switches_off():
    p = TurboSpec(margin=0.0)
    lat = latency(curve=[(1, 10.0), (64, 11.0)])
    b = BatchView([req("a"), req("b")])
    view_k = p.shapes(b, lat)["a"].depth
    assert view_k > 0
    for step in range(60):  # the draft really costs 40 ms per beam step: speculation never pays
        shapes = p.shapes(b, lat)
        k = shapes["a"].depth
        trees = {rid: chain([0.5] * s.depth) for rid, s in shapes.items()}
        p.select(b, trees, lat)
        acc = [RequestStep(rid, 0, depth=k, verified=k + 1, accepted=0, emitted=1) for rid in shapes]
        record = iteration(step, nodes=2 * (k + 1), target_ms=10.0, spec=2 if k else 0, draft_ms=40.0 * k + 1,
                           steps=acc)
        lat.observe_record(record, 0)  # as the engine feeds the replica's cost model
        p.observe(record)
    assert p.shapes(b, lat)["a"].depth == 0
    assert lat.draft_ms(2, 2, 1, 0) > 40.0  # the draft fit learned the real cost
    assert p.control.acceptance.rate_of("b") < p.control.acceptance.prior  # every step rejected at once


def test_turbospec_probes_after_a_long_off_period():
    p = TurboSpec(probe_every=5)
    big = BatchView([req(f"r{i}") for i in range(64)])
    lat = latency(curve=[(8, 10.0), (64, 38.0)])
    probes, depths = [], []
    for _ in range(17):
        shapes = p.shapes(big, lat)
        probes.append(sum(1 for s in shapes.values() if s.depth > 0))
        depths += [s.depth for s in shapes.values() if s.depth > 0]
    assert probes == [0, 0, 0, 0, 1] * 3 + [0, 0]  # one request, every 5th iteration
    assert sorted(depths) == [1, 2, 4]  # the chain's depth in turn: the draft's cost is fitted at several


@pytest.mark.parametrize("cls", [TurboSpec, Joint])
def test_a_held_off_probes_far_probes_times_less_often(cls):
    """While an off is held (far from paying), a probe comes after FAR_PROBES * probe_every iterations at k = 0;
    once the verdict is near again (a cheap draft), after probe_every."""
    p = cls(probe_every=5)
    lat = latency(curve=[(8, 10.0), (64, 38.0)])
    lat.draft.theta = [100.0, 10.0, 0.5, 0.0]  # a draft call costs more than the pass: far from paying
    big = BatchView([req(f"r{i}", tpot=1000.0) for i in range(64)])
    steps = 2 * 5 * FAR_PROBES + 3
    probes = [sum(1 for s in p.shapes(big, lat).values() if s.depth > 0) for _ in range(steps)]
    assert probes == ([0] * (5 * FAR_PROBES - 1) + [1]) * 2 + [0] * 3
    near = cls(probe_every=5)
    near_probes = [sum(1 for s in near.shapes(big, latency(curve=[(8, 10.0), (64, 38.0)])).values() if s.depth > 0)
                   for _ in range(10)]
    assert near_probes == [0, 0, 0, 0, 1] * 2 and not near.control.held


def test_turbospec_draft_prefill_skip_and_late_enablement():
    from specserve.gateway.sched.plan import DraftView, Limits, ReplicaView, SchedulerView
    p = TurboSpec()
    lat = latency(curve=[(8, 10.0), (64, 38.0)])
    p.control.thr = 2  # k = 0 was chosen at batch 2

    def view(reqs):
        return SchedulerView([], [], reqs, [ReplicaView(0, True, 1000, 0, len(reqs), lat)], DraftView(True, False),
                             Limits(8, 64, 8, 4))
    p.control.admit(view([req("a"), req("b"), req("c")]))
    assert p.control.draft_ok == {"a": False, "b": False, "c": False}  # 3 running > thr 2: skipped
    p.control.thr = float("inf")
    cheap = latency(curve=[(1, 10.0), (64, 11.0)])
    shapes = p.shapes(BatchView([req("a", lag=10), req("b", lag=1000)]), cheap)
    assert shapes["a"].depth > 0 and shapes["b"].depth == 0  # a enabled late (short lag); b's lag is too long


# ---------------------------------------------------------------- slo-goodput


def test_hopeless_request():
    # 50 ms TPOT, 10 decoded in 100 ms, 100 left: 5500 - 100 = 5400 ms left for 100 tokens
    r = req("a", tpot=50.0, decoded=10, elapsed=100.0, remaining=100)
    assert not hopeless(r, 54.0, 1.0)  # exactly 54 ms per token: still possible
    assert hopeless(r, 54.1, 1.0)
    assert not hopeless(r, 100.0, 2.0)  # two tokens per step: 50 ms per token
    late = req("b", tpot=50.0, decoded=10, elapsed=5000.0, remaining=5)  # 750 - 5000 < 0
    assert hopeless(late, 1.0, 10.0)


def test_slo_goodput_budget_comes_from_the_goodput_model_and_the_hopeless_are_skipped():
    p = SloGoodput()
    assert isinstance(make_policy("slo-goodput"), SloGoodput)
    lat = latency(curve=[(1, 10.0), (64, 11.0)])
    urgent = req("u", tpot=10.0, decoded=20, elapsed=230.0)  # A(r) = (230 + 10) / 10 - 20 = 4
    lost = req("x", tpot=1.0, decoded=20, elapsed=10000.0)  # hopeless: 120 - 10000 < 0
    fine = req("f", tpot=1000.0, decoded=20, elapsed=100.0)  # far ahead: A < 1
    b = BatchView([fine, lost, urgent])
    shapes = p.shapes(b, lat)
    k = p.control.current[0]
    assert k > 0 and all(s == Shape(k + 1, 1) for s in shapes.values())  # k* + e drafted
    assert p.budget[0] == 3 + 3 * k
    trees = {rid: chain([0.9] * s.depth) for rid, s in shapes.items()}
    sel = p.select(b, trees, lat)
    assert sum(len(v) for v in sel.values()) == p.budget[0]
    # the urgent request reaches its A_cap first; the hopeless one gets nodes only from the throughput phase
    assert len(sel["u"]) >= len(sel["x"])


def test_slo_goodput_hopeless_request_gets_no_slo_phase_nodes():
    p = SloGoodput()
    lat = latency(curve=[(1, 10.0), (64, 11.0)])
    lost = req("x", tpot=1.0, decoded=20, elapsed=10000.0)
    urgent = req("u", tpot=10.0, decoded=20, elapsed=230.0)
    b = BatchView([lost, urgent])
    p.shapes(b, lat)
    p.budget[0] = 2 + 3  # three draft tokens to share
    trees = {"x": chain([0.99] * 4), "u": chain([0.5] * 4)}
    sel = p.select(b, trees, lat)
    # the SLO phase serves u (A = 4) alone: its three best nodes; x (hopeless) would win every node on f̂
    assert sel == {"x": [0], "u": [0, 1, 2, 3]}


def test_slo_goodput_off_switch_at_high_load():
    p = SloGoodput()
    big = BatchView([req(f"r{i}") for i in range(64)])
    shapes = p.shapes(big, latency(curve=[(8, 10.0), (64, 38.0)]))
    assert all(s.depth == 0 for s in shapes.values())
    assert p.budget[0] == 64  # roots only


# ---------------------------------------------------------------- joint


def test_joint_states():
    p = Joint()
    assert isinstance(make_policy("joint"), Joint)
    # pace = (tpot * (decoded + remaining) - elapsed) / remaining; remaining = 100
    u = req("u", tpot=10.0, decoded=20, elapsed=230.0)
    assert u.pace_ms() == pytest.approx(9.7)
    assert p.state(u, 10.0) == AT_RISK  # its root alone (10 ms a token) falls behind 9.7
    assert p.state(u, 9.7) == SLACK
    assert p.state(req("f", tpot=1000.0), 10.0) == SLACK
    # lost only when a chain of K_max = 7 accepted whole (8 tokens a step) could not keep 9.7 ms a token
    assert p.state(u, 77.0) == AT_RISK and p.state(u, 78.0) == LOST
    assert p.state(req("x", tpot=1.0, decoded=20, elapsed=10000.0), 10.0) == LOST  # past its deadline


TIGHT_CURVE = [(1, 10.0), (8, 12.0), (16, 16.0), (64, 40.0)]  # verification costs: 0.5 ms a token above 8


def test_joint_drafts_for_the_at_risk_where_turbospec_would_not_draft_at_all():
    """8 requests with slack and 3 at risk (pace 12.1 ms): plain passes take 13.5 ms, so the three
    miss without drafts; chains for all eleven make the pass too long for them, and do not pay in
    tokens per ms either (TurboSpec: off). Chains for the three alone keep their pace."""
    lat = latency(baseline=12.0, curve=TIGHT_CURVE)
    lat.t_spec_ms = 13.5
    fine = [req(f"f{i}", tpot=1000.0) for i in range(8)]
    urgent = [req(f"u{i}", tpot=12.0, decoded=20, elapsed=230.0) for i in range(3)]
    p, turbo = Joint(tree_width=1), TurboSpec()  # chains: the trees are test_branching.py's
    shapes = p.shapes(BatchView([*fine, *urgent]), lat)
    k = p.control.current[0]
    assert k > 0 and shapes == {**{r.rid: Shape(0, 1) for r in fine}, **{r.rid: Shape(k, 1) for r in urgent}}
    assert all(s.depth == 0 for s in turbo.shapes(BatchView([*fine, *urgent]), lat).values())
    assert p.value(BatchView([*fine, *urgent]), lat, urgent, k) > p.value(BatchView([*fine, *urgent]), lat,
                                                                             [*fine, *urgent], k)


def test_joint_is_turbospec_when_every_request_keeps_its_pace_and_lost_ones_never_draft():
    lat = latency(curve=[(1, 10.0), (64, 11.0)])  # verification nearly free: drafting pays
    fine = [req("f", tpot=1000.0), req("g", tpot=1000.0)]
    p, turbo = Joint(tree_width=1), TurboSpec()  # chains: the trees are test_branching.py's
    assert p.shapes(BatchView(fine), lat) == turbo.shapes(BatchView(fine), lat)
    assert p.control.current[0] > 0
    lost = req("x", tpot=1.0, decoded=20, elapsed=10000.0)
    shapes = p.shapes(BatchView([*fine, lost]), lat)
    assert shapes["x"] == Shape(0, 1) and shapes["f"].depth > 0
    trees = {rid: chain([0.9] * s.depth) for rid, s in shapes.items()}
    assert p.select(BatchView([*fine, lost]), trees, lat) == {rid: list(range(s.depth + 1))
                                                              for rid, s in shapes.items()}  # chains verified whole


def test_joint_does_not_lengthen_the_pass_that_prompts_wait_behind_unless_its_tokens_pay_for_them():
    """Four requests with slack on a target whose verification costs 0.3 ms a token: alone they draft
    (TurboSpec's choice). With 30 requests waiting for admission, or prefilling on the replica, each
    would start as much later as the drafts lengthen the pass, and lose a token a pass for it: the
    chains do not pay that, and nobody drafts. One waiting request costs less than the chains gain."""
    lat = latency(curve=[(1, 10.0), (64, 29.0)])
    fine = [req(f"f{i}", tpot=1000.0) for i in range(4)]

    def depths(**kw) -> set[int]:
        return {s.depth for s in Joint(tree_width=1).shapes(BatchView(fine, **kw), lat).values()}

    alone = {s.depth for s in TurboSpec().shapes(BatchView(fine), lat).values()}
    assert depths() == alone and max(alone) > 0
    assert depths(waiting=30) == {0} and depths(prefilling=30) == {0}
    assert max(depths(waiting=1)) > 0


def test_joint_does_not_draft_a_prompt_past_its_ttft():
    """Four slack requests that draft alone share the replica with a prompt of 1,000 tokens going in at
    128 a pass (8 passes). With 900 ms left before its TTFT SLO the plain pass (about 10.5 ms) meets it
    and the drafting passes too: they draft. With 8.5 plain passes of time left, the drafting ones would
    bring its first token after the deadline: nobody drafts. With less time than 8 plain passes it is
    late anyway, and the chains are priced as without it."""
    lat = latency(curve=[(1, 10.0), (64, 29.0)])
    fine = [req(f"f{i}", tpot=1000.0) for i in range(4)]
    t0 = lat.target_ms(4 + 128)

    def depths(left_ms: float) -> set[int]:
        batch = BatchView(fine, prefill_tokens=128, prefilling=1, prompts=((1000, left_ms),))
        return {s.depth for s in Joint(tree_width=1).shapes(batch, lat).values()}

    plain = BatchView(fine, prefill_tokens=128, prefilling=1)
    alone = {s.depth for s in Joint(tree_width=1).shapes(plain, lat).values()}
    assert max(alone) > 0
    assert depths(900.0) == alone
    assert depths(8.5 * t0) == {0}
    assert depths(7.5 * t0) == alone


def test_a_prompts_ttft_is_kept_with_the_planners_margin_on_the_drafting_passes():
    """`makes_late`: 1,000 prompt tokens at 128 a pass take 8 passes; with 8.7 plain passes of time left,
    passes 5 % longer keep the deadline at their expected time, not with the 10 % by which slow prompt
    passes overran their price; a prompt that plain passes would bring late is late anyway."""
    batch = BatchView([], prefill_tokens=128, prompts=((1000, 8.7 * 10.0),))
    assert not makes_late(batch, 10.0, 10.5) and makes_late(batch, 10.0, 10.5, slow=0.1)
    assert not makes_late(BatchView([], prefill_tokens=128, prompts=((1000, 7.5 * 10.0),)), 10.0, 10.5, slow=0.1)


def test_a_prompts_last_pass_keeps_the_ttft_reserve_before_its_deadline():
    """`makes_late` plans a prompt's last pass to end by its deadline less `TTFT_RESERVE` of the time left (what
    follows that pass: the first token's commit and way out): 8 passes of 10.5 ms end at 84 ms, inside 85 ms
    but not inside 85 ms less 2 %."""
    assert TTFT_RESERVE == 0.02
    assert makes_late(BatchView([], prefill_tokens=128, prompts=((1000, 85.0),)), 10.0, 10.5)
    assert not makes_late(BatchView([], prefill_tokens=128, prompts=((1000, 86.0),)), 10.0, 10.5)


@pytest.mark.parametrize("held_off", ["prompt past its TTFT", "requests waiting"])
def test_joint_held_off_by_its_prices_does_not_skip_the_next_requests_draft_prefill(held_off):
    """Nobody drafts while a prompt would miss its TTFT behind drafting passes, or while 30 requests wait
    behind them; neither is TurboSpec's verdict that drafting does not pay at this batch size, so the
    draft-prefill skip threshold stays unset (requests that start decoding meanwhile keep their draft
    prefill and may draft later). Drafting that does not pay sets it (test_joint_off_switch_when_nothing_pays)."""
    lat = latency(curve=[(1, 10.0), (64, 29.0)])
    fine = [req(f"f{i}", tpot=1000.0) for i in range(4)]
    t0 = lat.target_ms(4 + 128)
    p = Joint(tree_width=1)
    batch = BatchView(fine, prefill_tokens=128, prefilling=1, prompts=((1000, 8.5 * t0),)) \
        if held_off == "prompt past its TTFT" else BatchView(fine, waiting=30)
    assert {s.depth for s in p.shapes(batch, lat).values()} == {0}
    assert p.control.thr == math.inf


def test_joint_off_switch_when_nothing_pays():
    p = Joint()
    big = BatchView([req(f"r{i}") for i in range(64)])
    shapes = p.shapes(big, latency(curve=[(8, 10.0), (64, 38.0)]))
    assert all(s.depth == 0 for s in shapes.values())
    assert p.control.thr == 64  # TurboSpec's draft-prefill skip engages


def test_joint_keeps_the_draft_prefill_of_a_request_that_starts_at_risk():
    """Under load (more running than the skip threshold), TurboSpec skips every new request's draft
    prefill; `joint` keeps it for one whose root alone falls behind its pace, so that it can draft later.
    The numbers are those of the collapsed run (bench/results/sweep-sim-7b-x4-collapse20/
    joint@slo-rate12-run3.jsonl): from 12 s on, every critical request (TPOT 52.97 ms) decoded one
    token a step at about 81 ms a step, and from 13.3 s the admission refused 105 arrivals in a row."""
    from specserve.gateway.sched.plan import DraftView, Limits, ReplicaView, SchedulerView
    lat = latency(curve=[(8, 10.0), (64, 38.0)])
    lat.t_spec_ms = 81.0  # the replica's measured iteration under that load
    critical, relaxed = req("c", tpot=52.97, decoded=0, elapsed=0.0), req("r", tpot=423.8, decoded=0, elapsed=0.0)
    view = SchedulerView([], [], [critical, relaxed], [ReplicaView(0, True, 1000, 0, 2, lat)], DraftView(True, False),
                         Limits(8, 64, 8, 4))
    for p, kept in ((TurboSpec(), {"c": False, "r": False}), (Joint(), {"c": True, "r": False})):
        p.control.thr = 1  # k = 0 was chosen at batch 1
        p.decide(view)
        assert p.control.draft_ok == kept


# ---------------------------------------------------------------- Nightjar


def test_bandit_converges_to_the_best_arm_on_a_synthetic_reward():
    from specserve.gateway.sched.policy.nightjar import Bandit
    means = [1.0, 1.3, 1.1, 0.8]  # tokens per ms; arm 1 is best
    b = Bandit([(0, 1), (1, 1), (2, 1), (4, 2)], explore_cap=0.05, seed=1)
    rng = random.Random(5)
    chosen = []
    for _ in range(3000):
        i = b.choose(8, [0, 1, 2, 3])
        chosen.append(i)
        b.update(8, i, means[i] + rng.uniform(-0.2, 0.2), 10.0)
    late = chosen[-1000:]
    assert late.count(1) >= 900
    bucket = b.bucket(8)
    assert bucket.explored <= 0.05 * bucket.rounds + 1  # the exploration cap holds
    assert chosen[:4] == [0, 1, 2, 3]  # every arm once first
    assert b.bucket_of(5) == 8 and b.bucket_of(8) == 8 and b.bucket_of(9) == 16 and b.bucket_of(1) == 1
    assert b.bucket(3) is not bucket  # another batch-size bucket learns alone


def test_bandit_switching_cost_keeps_speculation_off_while_the_draft_lags():
    from specserve.gateway.sched.policy.nightjar import Bandit
    b = Bandit([(0, 1), (2, 1)], explore_cap=0.0)
    for _ in range(30):
        for i, g in ((0, 1.0), (1, 1.1)):
            b.update(4, i, g, 10.0)
    assert b.choose(4, [0, 1], switch_ms=0.0) == 1  # drafting pays 10% once the draft is in sync
    # a 500 ms catch-up, amortised over 8 rounds: 1/1.1 + 500 / (8 * 1.1 * 10) > 1/1.0
    assert b.choose(4, [0, 1], switch_ms=500.0) == 0
    assert b.choose(4, [0, 1], switch_ms=0.5) == 1  # a small catch-up does not outweigh the gain


def test_offload_reload_hysteresis_on_a_scripted_pressure_trace():
    from specserve.gateway.sched.plan import Residency
    from specserve.gateway.sched.policy.nightjar import Residence
    r = Residence(offload_free=0.10, reload_free=0.30, persist=3, dwell_ms=1000.0)
    KEEP, OFF, ON = Residency.KEEP, Residency.OFFLOAD, Residency.RELOAD
    offloaded = False
    got = []
    # (unreserved fraction, waiting, ms elapsed after the iteration)
    trace = [(0.50, 0, 100), (0.05, 4, 100), (0.05, 4, 100), (0.20, 4, 100),  # a dip, reset by 0.20
             (0.05, 4, 100), (0.05, 4, 100), (0.05, 4, 100),  # three in a row: offload
             (0.50, 0, 100), (0.50, 0, 100),  # plenty free at once, but the dwell (1 s) holds it
             (0.50, 3, 1000), (0.25, 0, 500),  # waiting; then dwelt, nobody waits, but below reload_free
             (0.35, 0, 100),  # nobody waits, above 0.30, dwelt 1.3 s: reload
             (0.05, 4, 100), (0.05, 4, 100), (0.05, 4, 100), (0.05, 4, 100),  # pressure again, but dwell
             (0.05, 4, 700), (0.05, 4, 100)]  # dwelt: offload
    for free, waiting, ms in trace:
        res = r.step(free, waiting, offloaded)
        got.append(res)
        if res is OFF:
            offloaded = True
        elif res is ON:
            offloaded = False
        r.chose(2)  # speculating: only the waiting queue makes pressure
        r.elapse(ms)
    assert got == [KEEP, KEEP, KEEP, KEEP, KEEP, KEEP, OFF, KEEP, KEEP, KEEP, KEEP, ON,
                   KEEP, KEEP, KEEP, KEEP, KEEP, OFF]


def test_offload_needs_the_queue_or_speculation_off():
    from specserve.gateway.sched.plan import Residency
    from specserve.gateway.sched.policy.nightjar import Residence
    r = Residence(offload_free=0.10, reload_free=0.30, persist=3, dwell_ms=0.0)
    for _ in range(5):  # KV is scarce but nobody waits and the arms draft: keep the draft
        assert r.step(0.05, 0, False) is Residency.KEEP
        r.chose(2)
    got = []
    for _ in range(6):  # the arms turned to (0, 1): after `persist` such arms and `persist` low steps
        got.append(r.step(0.05, 0, False))
        r.chose(0)
    # the window of 3 arms is all (0, 1) from the 4th step on; the low count then needs 3 steps
    assert got == [Residency.KEEP] * 5 + [Residency.OFFLOAD]
    with pytest.raises(ValueError):
        Residence(offload_free=0.4, reload_free=0.3)


def test_nightjar_policy_marks_requests_cold_across_an_offload():
    from specserve.gateway.sched.plan import DraftView, Limits, ReplicaView, Residency, SchedulerView
    from specserve.gateway.sched.policy.nightjar import Nightjar, NightjarOptions
    p = Nightjar([(2, 1)], NightjarOptions(nightjar_persist=1, nightjar_dwell_s=0.0))
    lat = latency()

    def view(reqs, reserved, waiting, offloaded):
        from specserve.gateway.sched.plan import WaitingView
        w = [WaitingView(f"w{i}", 8, 8, 1, "t", 50.0, 1000.0, 0.0) for i in range(waiting)]
        return SchedulerView(w, [], reqs, [ReplicaView(0, True, 100, reserved, len(reqs), lat)],
                             DraftView(True, offloaded), Limits(8, 64, 8, 4))
    d = p.decide(view([req("a"), req("b")], 50, 0, False))
    assert d.residency is Residency.KEEP and d.shapes == {"a": Shape(2, 1), "b": Shape(2, 1)}
    d = p.decide(view([req("a"), req("b")], 95, 3, False))  # 5% free, 3 waiting: offload (persist 1)
    assert d.residency is Residency.OFFLOAD and d.shapes == {}
    d = p.decide(view([req("a"), req("b"), req("c")], 95, 2, True))
    assert d.residency is Residency.KEEP and d.shapes == {}
    d = p.decide(view([req("a"), req("c")], 40, 0, True))  # 60% free, nobody waits: reload
    assert d.residency is Residency.RELOAD
    d = p.decide(view([req("a"), req("c"), req("n")], 40, 0, False))
    assert d.shapes == {"a": Shape(0, 1), "c": Shape(0, 1), "n": Shape(2, 1)}  # cold stay off; n is new


def test_turbospec_probe_takes_the_least_draft_lag():
    p = TurboSpec(probe_every=1)
    big = BatchView([req(f"r{i}", lag=100 - i) for i in range(64)])
    lat = latency(curve=[(8, 10.0), (64, 38.0)])
    probed = [rid for _ in range(FAR_PROBES) for rid, s in p.shapes(big, lat).items() if s.depth > 0]
    assert probed == ["r63"]  # (this far from paying the off is held: one probe in FAR_PROBES steps)


def test_target_time_is_measured_per_token_count_and_interpolated():
    sm = latency()  # line 6 + 0.5 t
    for _ in range(3):
        sm.observe_record(iteration(1, nodes=1, target_ms=14.0), 0)
        sm.observe_record(iteration(2, nodes=5, target_ms=30.0), 0)
    assert sm.target_ms(1) == pytest.approx(14.0)  # measured, although the line says 6.5
    assert sm.target_ms(3) == pytest.approx(22.0)  # between 1 and 5
    line = sm.line.predict
    assert sm.target_ms(9) == pytest.approx(30.0 + line([1.0, 9.0]) - line([1.0, 5.0]))  # the line, through 5


def test_pause_measures_the_plain_pass_while_speculating():
    p = TurboSpec(probe_every=4)
    small = BatchView([req("a")])
    lat = latency(curve=[(1, 10.0), (64, 11.0)])
    depths = [p.shapes(small, lat)["a"].depth for _ in range(8)]
    assert depths[3] == 0 and depths[7] == 0 and all(d > 0 for i, d in enumerate(depths) if i not in (3, 7))


def test_turbospec_threshold_not_set_by_a_request_that_cannot_draft():
    p = TurboSpec()
    p.shapes(BatchView([req("a", remaining=1)]), latency(curve=[(1, 10.0), (64, 11.0)]))  # one token left: k = 0
    assert p.control.thr == float("inf")  # not a verdict on drafting at batch 1
