"""PassCost (services/gateway/perf/cost.py), the gateway's one cost model, on hand-built records: no processes.

- what it reads from an IterationRecord (the replica's pass, the KV held, the draft call's shape);
- every iteration is priced before it is fitted, and the relative error of those predictions is kept;
- the moving average of iterations (AdaServe's t_spec) and the fixed costs of the three-service path;
- the planner (admission/) and the speculation policies price the same iteration the same.
"""

from __future__ import annotations

import random

import pytest

from specserve.gateway.perf.cost import PassCost, PassSample, sample_of
from specserve.gateway.perf.record import DraftStep, IterationRecord, ReplicaStep, RequestStep


def record(*, nodes: int, service_ms: float, total_ms: float, replica: int = 0, depth: int = 0, spec: int = 0,
           lag: int = 0, draft_ms: float = 0.0) -> IterationRecord:
    r = IterationRecord(1, requests=[RequestStep("a", replica, depth=depth, width=2 if depth else 1, verified=nodes)])
    r.replicas = [ReplicaStep(replica, tree_nodes=nodes, call_ms=service_ms + 1.0, service_ms=service_ms)]
    if spec:
        r.draft = DraftStep(requests=spec, lag=lag, call_ms=draft_ms + 0.5, service_ms=draft_ms)
    r.target_phase_ms = service_ms + 1.0
    r.total_ms = total_ms
    return r


def test_a_record_is_read_as_one_replicas_sample():
    s = sample_of(record(nodes=6, service_ms=10.0, total_ms=20.0, depth=3, spec=2, lag=7, draft_ms=4.0), 0, kv=33)
    assert s == PassSample(6, 10.0, 11.0, 20.0, 20.0 - 4.5 - 11.0, kv=33, decoded=True, depth=3, spec=2, width=2,
                           lag=7, draft_service_ms=4.0, draft_call_ms=4.5)
    assert sample_of(record(nodes=6, service_ms=10.0, total_ms=20.0), 1) is None  # no pass on replica 1


def test_a_pass_that_captured_a_cuda_graph_is_not_a_sample():
    """A first pass of its shape on a GPU (graph capture) costs tens of times its replays: neither the fit nor the
    margins see it."""
    r = record(nodes=6, service_ms=300.0, total_ms=310.0)
    r.replicas[0].warmup = True
    assert sample_of(r, 0) is None
    cost = PassCost(8, 10.0)
    cost.observe_record(r, 0)
    assert cost.error_summary() == {"iterations": 0}
    r = record(nodes=6, service_ms=10.0, total_ms=90.0, depth=3, spec=2, draft_ms=75.0)
    assert sample_of(r, 0) is not None
    r.draft.warmup = True  # the draft call captured: its time says nothing of the next call
    assert sample_of(r, 0) is None


def test_each_iteration_is_priced_before_it_is_fitted():
    cost = PassCost(8, 10.0)  # no curve: flat at the baseline
    assert cost.error_summary() == {"iterations": 0}
    cost.observe_record(record(nodes=8, service_ms=15.0, total_ms=20.0), 0)
    assert cost.error_summary()["median"] == pytest.approx(0.5)  # priced at 10 ms, took 20
    for _ in range(30):
        cost.observe_record(record(nodes=8, service_ms=15.0, total_ms=20.0), 0)
    # the service time, the round trip (1 ms) and the gateway's share (total - call = 4 ms) now add up
    assert cost.iteration_ms(8) == pytest.approx(20.0, rel=0.01)
    assert cost.error_summary()["iterations"] == 31
    assert cost.error_summary()["p90"] < 0.6


def test_t_spec_is_a_moving_average_of_the_iterations_that_decoded():
    cost = PassCost(64, 10.0, smoothing=0.25)
    cost.observe(PassSample(4, 10.0, 11.0, 30.0, 1.0))  # 10 + 0.25 * 20
    assert cost.t_spec_ms == pytest.approx(15.0)
    cost.observe(PassSample(4, 10.0, 11.0, 100.0, 1.0, decoded=False))  # prefill only: says nothing of t_spec
    assert cost.t_spec_ms == pytest.approx(15.0)
    assert PassCost(64, 10.0, t_spec_ms=4.0).t_spec_ms == 4.0  # an explicit seed is kept


def test_the_draft_term_is_fitted_from_the_draft_call_and_priced_only_when_someone_drafts():
    cost = PassCost(8, 10.0)
    for _ in range(50):
        cost.observe_record(record(nodes=6, service_ms=10.0, total_ms=40.0, depth=4, spec=2, draft_ms=24.0), 0)
    assert cost.draft_ms(4, 2, 2, 0) == pytest.approx(24.0, rel=0.05)
    assert cost.iteration_ms(6, 4, 2, 2) - cost.iteration_ms(6) == pytest.approx(24.5, rel=0.05)  # + its round trip
    assert cost.iteration_ms(6, 4, 0, 2) == cost.iteration_ms(6)  # nobody drafts: no call


def test_the_planner_and_the_policy_price_one_iteration_the_same():
    from specserve.gateway.sched.policy import BatchView, RequestView
    from specserve.gateway.sched.policy.turbospec import GoodputControl

    cost = PassCost(8, 10.0, [(1, 8.0), (64, 40.0)])
    for n in (1, 2, 4, 8, 16):
        for _ in range(5):
            cost.observe_record(record(nodes=n, service_ms=8.0 + 0.5 * n, total_ms=10.0 + 0.5 * n), 0)
    batch = BatchView([RequestView(f"r{i}", "t", 50.0, 1000.0, 3, 90.0, 100) for i in range(4)])
    _, policy_ms = GoodputControl().step_ms(batch, cost, batch.requests, 0)
    assert policy_ms == pytest.approx(cost.iteration_ms(4))
    assert cost.planned_ms(4) >= policy_ms  # the planner adds its margin to the same prediction


def test_one_stalled_pass_does_not_set_a_counts_time_for_good():
    # a 256-token chunk timed once, stalled (the machine busy elsewhere), then only short passes: at
    # concurrency 1 that count is never timed again, and the arrival check prices prompts from it
    cost = PassCost(8, 18.6, [(8, 27.0), (256, 161.0)])
    for n, ms in ((46, 57.0), (154, 65.0)):
        cost.observe(PassSample(n, ms, ms + 1.0, ms + 2.0, 0.5))
    cost.observe(PassSample(256, 7600.0, 7601.0, 7602.0, 0.5))
    assert cost.target_ms(256) <= 3 * (65.0 + 0.6 * 102)  # at most 3x its price before that pass
    for _ in range(10):  # a slower machine is still learnt, a few passes later
        cost.observe(PassSample(256, 1000.0, 1001.0, 1002.0, 0.5))
    assert cost.target_ms(256) == pytest.approx(1000.0, rel=0.1)


def test_short_passes_alone_do_not_tilt_the_slope_the_table_is_extended_with():
    # concurrency 1: decode steps of 1-5 tokens, noisy, then a prompt larger than any timed pass
    rng = random.Random(3)
    cost = PassCost(8, 18.6, [(8, 27.0), (64, 61.0), (256, 161.0)])
    cost.observe(PassSample(60, 40.0, 41.0, 42.0, 0.5))
    for _ in range(500):
        n = rng.randint(1, 5)
        ms = 14.0 + 1.5 * n + rng.expovariate(1 / 3)
        cost.observe(PassSample(n, ms, ms + 1.0, ms + 2.0, 0.5))
    slope = (cost.target_ms(256) - cost.target_ms(60)) / (256 - 60)
    assert 0.3 < slope < 0.8  # the profile's 0.53 ms per token, not what 1-5 token passes suggest


def test_small_passes_are_priced_by_the_lone_requests_chains_beyond_the_counts_timed():
    """At one request only the 1-token pass is timed: 2..8 tokens are priced by the profile's lone chains (what
    one more token costs there), not by the batch curve's slope; beyond 8 by the slope."""
    curve = [(8, 40.0), (16, 51.0), (32, 73.0)]  # 1.375 ms a token at batch 8
    single = [(1, 5.0), (2, 5.8), (4, 7.6), (8, 15.0)]
    plain, shaped = PassCost(8, 38.0, curve), PassCost(8, 38.0, curve, single=single)
    for cost in (plain, shaped):
        for _ in range(5):
            cost.observe(PassSample(1, 4.0, 5.0, 6.0, 0.5))
    slope = shaped.line.theta[1]  # the line's, refitted online
    assert 1.0 < slope < 2.5 and plain.target_ms(2) == pytest.approx(4.0 + plain.line.theta[1])
    assert shaped.target_ms(2) == pytest.approx(4.0 + 0.8)
    assert shaped.target_ms(3) == pytest.approx(4.0 + 1.7)  # between the lone chains' points
    assert shaped.target_ms(12) == pytest.approx(4.0 + 10.0 + 4 * slope)
    # a lone chain timed faster than a shorter one (noise) never prices a longer pass cheaper
    noisy = PassCost(8, 38.0, curve, single=[(1, 5.0), (2, 4.9), (4, 7.6)])
    noisy.observe(PassSample(1, 4.0, 5.0, 6.0, 0.5))
    assert noisy.target_ms(2) == pytest.approx(4.0)


def test_a_sorted_window_gives_numpys_quantiles_to_the_last_bit():
    import numpy as np

    from specserve.gateway.perf.quantiles import SortedWindow

    rng = random.Random(7)
    w, kept = SortedWindow(), []
    for i in range(3000):
        v = rng.choice([rng.gauss(0, 5), rng.uniform(-1, 1), float(rng.randint(-3, 3))])  # ties included
        w.add(v)
        kept.append(v)
        if len(kept) > 97:
            w.remove(kept.pop(rng.randrange(len(kept))))
        for q in (0.0, 0.1, 0.5, 0.9, 1.0, rng.random()):
            assert w.quantile(q) == float(np.quantile(kept, q)), (i, q)


def test_the_margins_follow_the_window_of_residuals_as_it_moves():
    """The planner's margin quantiles, kept sorted as passes come and go, equal numpy's over the window itself."""
    import numpy as np

    from specserve.gateway.perf.cost import FAST_QUANTILE, HIGH_QUANTILE, LOW_QUANTILE

    cost = PassCost(budget_tokens=16, baseline_iteration_ms=10.0, window=50)
    rng = random.Random(3)
    for i in range(400):
        prompt = rng.random() < 0.3
        nodes = rng.randint(64, 256) if prompt else rng.randint(1, 16)
        ms = rng.uniform(5.0, 40.0)
        s = PassSample(nodes, ms, ms + 1.0, ms + 3.0, 1.0, prompt=nodes if prompt else 0, decoded=not prompt)
        cost.observe(s)
        low = [r for p, r, _ in cost.residuals if not p]
        high = [r / max(t, 1e-3) for p, r, t in cost.residuals if p]
        want = (max(0.0, float(np.quantile(low, LOW_QUANTILE))) if low else 0.0,
                max(0.0, float(np.quantile(high, HIGH_QUANTILE))) if high else 0.0,
                max(-0.9, min(0.0, float(np.quantile(high, FAST_QUANTILE)))) if high else 0.0)
        assert cost._margin_stats() == want, i


def test_the_scalar_interpolation_is_numpys_to_the_bit():
    import numpy as np

    from specserve.gateway.perf.cost import _interp

    rng = random.Random(5)
    for _ in range(300):
        xs = sorted(rng.sample(range(1, 200), rng.randint(2, 9)))
        ys = list(np.maximum.accumulate([rng.uniform(0.1, 50.0) for _ in xs]))
        for x in [*xs, *(rng.uniform(0, 210) for _ in range(20)), *(float(rng.randint(0, 210)) for _ in range(10))]:
            x = min(x, xs[-1])  # (PassCost asks within the chains' counts)
            assert _interp(x, [float(v) for v in xs], ys) == float(np.interp(x, xs, ys)), (x, xs, ys)


def test_a_pricer_prices_as_planned_ms_and_the_searches_agree():
    cost = PassCost(256, 1.0, [(8, 1.0), (64, 1.5), (256, 3.0)], single=[(1, 0.9), (2, 0.92), (4, 0.95), (8, 1.0)])
    rng = random.Random(2)
    for _ in range(200):
        n = rng.choice([1, 5, 17, 64, 100, 300])
        cost.observe(PassSample(n, 1 + n * 0.008 + rng.random() * 0.1, 1.2 + n * 0.008, 1.5 + n * 0.008, 0.2,
                                kv=rng.randint(10, 400), prompt=n if n > 64 else 0, depth=rng.choice([0, 2]),
                                spec=rng.choice([0, 3]), draft_service_ms=0.3, draft_call_ms=0.5))
    for steps, kv, margin in [(0, 0, True), (2, 50, True), (0, 500, False), (3, 120, False)]:
        priced = cost.pricer(steps, kv, margin)
        for n in [1, 2, 3, 8, 9, 64, 200, 256, 257, 1000, 5000]:
            assert priced(n) == cost.planned_ms(n, steps, kv, margin)
            spec = round(max(cost.spec, 1.0)) if steps else 0
            expected = cost.iteration_ms(n, steps, spec, 1, round(max(cost.lag, 0.0)), kv)
            assert priced(n) == (expected + cost.margin_ms(n, expected) if margin else expected)
        for ms in [0.5, 2.0, 5.0, 40.0]:
            cap = cost.time2bs(ms, steps, kv, margin)
            assert cap == 0 or priced(cap) <= ms + 1e-9
            assert priced(cap + 1) > ms + 1e-9


def test_a_step_without_drafts_is_priced_with_the_gateways_share_of_such_steps_only():
    cost = PassCost(64, 10.0)
    plain = PassSample(64, 3.0, 3.5, 5.0, 1.0)  # the gateway's own 1 ms of a plain step
    drafted = PassSample(64, 3.0, 3.5, 25.0, 4.0, depth=7, spec=40, draft_service_ms=15.0, draft_call_ms=15.5)
    for _ in range(10):
        cost.observe(plain)
    before = cost.iteration_ms(64)
    for _ in range(30):  # a policy that drafts: its steps' own share (trees selected and built) is 4 ms
        cost.observe(drafted)
    assert cost.iteration_ms(64) == pytest.approx(before)  # not 3 ms dearer
    assert cost.iteration_ms(64, 7, 40, 1) - cost.iteration_ms(64) == pytest.approx(
        cost.draft_ms(7, 40, 1, 0) + 0.5 + 3.0, rel=1e-6)  # the call, its round trip, the extra share
    fresh = PassCost(64, 10.0)
    fresh.observe(drafted)  # one kind seen: it stands in for the other
    assert fresh.iteration_ms(64) == pytest.approx(fresh.iteration_ms(64, 7, 40, 1) - fresh.draft_ms(7, 40, 1, 0) - 0.5)
