"""The gateway's Prometheus exposition: `GatewayMetrics.render()` parsed back with prometheus_client's own
parser gives the exported names, types, labels and help, and exact values after known calls."""

from __future__ import annotations

import math
import random

import prometheus_client
import pytest
from prometheus_client import exposition
from prometheus_client.parser import text_string_to_metric_families

from specserve.gateway.obs.metrics import (
    CONTENT_TYPE,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    GatewayMetrics,
)
from tests.support.records import sample_records

MODEL = "demo"
M = ("model_name",)

# Every exported metric as the TYPE line names it: (type, label names besides le, help text).
EXPORTED = {
    "vllm:num_requests_running": ("gauge", M, "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", M, "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", M, "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prompt_tokens_total": ("counter", M, "Number of prefill tokens processed."),
    "vllm:generation_tokens_total": ("counter", M, "Number of generation tokens processed."),
    "vllm:request_success_total": ("counter", (*M, "finished_reason"), "Count of successfully processed requests."),
    "vllm:num_preemptions_total": ("counter", M, "Cumulative number of preemption from the engine."),
    "vllm:prefix_cache_queries_total": ("counter", M, "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits_total": ("counter", M, "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:time_to_first_token_seconds": ("histogram", M, "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("histogram", M, "Histogram of inter-token latency in seconds."),
    "vllm:request_time_per_output_token_seconds": ("histogram", M,
                                                   "Histogram of time_per_output_token_seconds per request."),
    "vllm:e2e_request_latency_seconds": ("histogram", M, "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": ("histogram", M, "Histogram of time spent in WAITING phase for request."),
    "vllm:iteration_tokens_total": ("histogram", M, "Histogram of number of tokens per engine_step."),
    "vllm:spec_decode_num_drafts_total": ("counter", M, "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens_total": ("counter", M, "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens_total": ("counter", M, "Number of accepted tokens."),
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": ("counter", (*M, "position"),
                                                           "Accepted tokens per draft position (0 = first draft "
                                                           "token)."),
    "specserve:iteration_draft_seconds_total": ("counter", M, "Seconds the draft service spent in speculation "
                                                              "calls (inside the service)."),
    "specserve:iteration_target_seconds_total": ("counter", M, "Seconds the target service spent in forward calls "
                                                               "(inside the service)."),
    "specserve:iteration_transport_seconds_total": ("counter", M, "Seconds of draft and target calls spent outside "
                                                                  "the services (serialization, sockets, waiting "
                                                                  "for the reply)."),
    "specserve:iteration_schedule_seconds_total": ("counter", M, "Seconds of iterations outside service calls: "
                                                                 "admission, policy, node selection, commit, "
                                                                 "streaming."),
    "specserve:iterations_total": ("counter", M, "Engine iterations run."),
    "specserve:draft_catchup_seconds_total": ("counter", M, "Seconds the draft spent appending committed tokens to "
                                                            "its KV (catch-up), inside Speculate calls on the "
                                                            "critical path."),
    "specserve:draft_beam_seconds_total": ("counter", M, "Seconds the draft spent in beam steps, inside Speculate "
                                                         "calls."),
    "specserve:draft_sync_seconds_total": ("counter", M, "Seconds the draft spent in calls beside the target "
                                                         "pass (eager syncs, drafting ahead)."),
    "specserve:iteration_pass_seconds_total": ("counter", M, "Seconds of the target's model pass alone (a part of "
                                                             "the target service's seconds)."),
    "specserve:draft_ahead_total": ("counter", M, "Trees drafted ahead beside the target pass (--overlap)."),
    "specserve:draft_ahead_hits_total": ("counter", M, "Trees drafted ahead whose guess the target's answer "
                                                       "matched (used next step)."),
    "specserve:passes_sent_ahead_total": ("counter", M, "Target passes sent before the replica's previous pass "
                                                        "was committed (--async-scheduling)."),
    "specserve:chains_sent_ahead_total": ("counter", M, "Chains sent one step ahead, drafted on a guess of the "
                                                        "answer in flight (--async-scheduling)."),
    "specserve:chains_sent_ahead_hits_total": ("counter", M, "Chains sent ahead whose guess the answer matched "
                                                             "(verified as drafted; the others verified their root "
                                                             "alone)."),
    "specserve:requests_received_total": ("counter", M, "Requests received (queued)."),
    "specserve:requests_moved_total": ("counter", M, "Requests moved off a target replica that was lost, to resume "
                                                     "on another by recompute."),
    "specserve:request_slo_total": ("counter", (*M, "tier", "met"),
                                    "Finished requests by SLO tier and whether the SLO was met."),
    "specserve:request_ttft_seconds": ("histogram", (*M, "tier"), "Time to first token of finished requests, by "
                                                                  "SLO tier, seconds."),
    "specserve:request_tpot_seconds": ("histogram", (*M, "tier"), "Time per output token of finished requests "
                                                                  "(after the first), by SLO tier, seconds."),
    "specserve:budget_tokens": ("gauge", M, "Token budget B of one target pass (roots included)."),
    "specserve:request_errors_total": ("counter", (*M, "code"), "Requests that ended in an error, by code."),
    "specserve:admission_total": ("counter", (*M, "tier", "outcome"),
                                  "SLO-aware admission outcomes by tier: declined (a replica's planner said no), "
                                  "best_effort (admitted without an SLO) and refused (503); "
                                  "zero under --admission fifo."),
    "specserve:replica_up": ("gauge", (*M, "replica"), "Whether the replica is up (1) or not (0)."),
    "specserve:replica_running": ("gauge", (*M, "replica"), "Requests running on the replica."),
    "specserve:replica_kv_usage_perc": ("gauge", (*M, "replica"),
                                        "KV-cache usage of the replica. 1 means 100 percent usage."),
}
BOUNDS = {
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": TOKEN_LATENCY_BUCKETS,
    "vllm:request_time_per_output_token_seconds": TOKEN_LATENCY_BUCKETS,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
}
# As vLLM sets them (pinned here, so a change to the module's constants shows up as a failure).
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0)
VLLM_TOKEN_LATENCY = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0)
VLLM_REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def parse(text: str) -> dict:
    """{(sample name, frozenset(labels)): value}, through prometheus_client's parser; no sample twice."""
    assert text.endswith("\n")
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
    return samples


def typed(text: str) -> dict[str, tuple[str, str]]:
    """{name on the TYPE line: (type, help)}, in the order rendered, via the parser's families."""
    out = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name  # the parser drops _total
        assert name not in out, f"{name} rendered twice"
        out[name] = (family.type, family.documentation)
    return out


def value(samples: dict, name: str, model: str = MODEL, **labels) -> float:
    return samples[(name, frozenset({"model_name": model, **{k: str(v) for k, v in labels.items()}}.items()))]


def buckets(samples: dict, name: str, **labels) -> list[tuple[float, float]]:
    """[(le, cumulative count)] of one histogram series, by increasing le."""
    want = {"model_name": MODEL, **labels}
    out = []
    for (n, ls), v in samples.items():
        d = dict(ls)
        le = d.pop("le", None)
        if n == f"{name}_bucket" and d == want:
            out.append((float(le), v))
    return sorted(out)


def label_names(samples: dict) -> dict[str, set[frozenset[str]]]:
    """{sample name: the label-name sets its samples carry (le left out)}."""
    out: dict[str, set] = {}
    for n, ls in samples:
        out.setdefault(n, set()).add(frozenset(k for k, _ in ls) - {"le"})
    return out


def drive(m: GatewayMetrics) -> None:
    """A known sequence of engine calls; the expected values are in test_values_after_a_known_sequence."""
    m.set_budget(24)
    for _ in range(3):
        m.on_queued()
    m.on_admitted(0.2)
    m.on_admitted(1.2)
    m.on_first_token(0.03)
    m.on_tokens(1, 0.02)  # one token after 20 ms
    m.on_tokens(4, 0.08)  # four tokens after 80 ms: 4 samples of 20 ms
    m.on_tokens(2, 0.5)  # two tokens after 500 ms: 2 samples of 250 ms
    m.on_tokens(0, 1.0)  # nothing
    for record in sample_records():
        m.on_iteration(record)
    m.on_finished("stop", 12, 8, 0.9, 0.05, "chat", True, 0.25)
    m.on_finished("length", 30, 1, 2.0, None, "urgent", False, 1.5)
    m.on_finished("stop", 5, 3, 0.4, 0.1, "chat", None)
    m.on_error("too_large")
    m.on_error("too_large")
    m.on_error("bad_request")
    m.on_preempted()
    m.on_preempted(2)
    m.on_prefix_cache(40, 32)
    m.on_prefix_cache(24, 16)
    m.on_admission("refused", {"chat": 2})
    m.on_admission("best_effort", {"urgent": 1})
    m.set_load(running=2, waiting=5, kv_usage=0.375)
    m.set_replica("r0", up=True, running=3, kv_usage=0.5)
    m.set_replica("r1", up=False, running=0, kv_usage=0.0)


# ------------------------------------------------------------------------------------------------ names
def test_every_exported_name_type_help_and_labels():
    m = GatewayMetrics(MODEL)
    drive(m)
    text = m.render()
    assert typed(text) == {name: (kind, doc) for name, (kind, _, doc) in EXPORTED.items()}
    # the raw TYPE lines name counters with their _total, as Prometheus (and vLLM's dashboards) see them
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert type_lines == [f"# TYPE {name} {kind}" for name, (kind, _, _) in EXPORTED.items()]
    names = label_names(parse(text))
    for name, (kind, labels, _) in EXPORTED.items():
        series = [f"{name}_bucket", f"{name}_sum", f"{name}_count"] if kind == "histogram" else [name]
        for s in series:
            assert names[s] == {frozenset(labels)}, s


def test_histogram_bucket_bounds_are_vllms():
    assert TTFT_BUCKETS == VLLM_TTFT and TOKEN_LATENCY_BUCKETS == VLLM_TOKEN_LATENCY
    assert REQUEST_LATENCY_BUCKETS == VLLM_REQUEST_LATENCY and ITERATION_TOKENS_BUCKETS == VLLM_ITERATION_TOKENS
    s = parse(GatewayMetrics(MODEL).render())
    for name, bounds in BOUNDS.items():
        assert [le for le, _ in buckets(s, name)] == [*map(float, bounds), math.inf], name
    # le as Prometheus writes it: 1.0, not 1; +Inf last
    text = GatewayMetrics(MODEL).render()
    assert 'vllm:iteration_tokens_total_bucket{le="1.0",model_name="demo"} 0.0' in text.splitlines()
    assert 'vllm:iteration_tokens_total_bucket{le="+Inf",model_name="demo"} 0.0' in text.splitlines()


def test_fresh_metrics_have_the_zero_series_dashboards_query():
    s = parse(GatewayMetrics(MODEL).render())
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "specserve:iteration_draft_seconds_total",
                 "specserve:iteration_target_seconds_total", "specserve:iteration_schedule_seconds_total",
                 "specserve:iterations_total", "specserve:requests_received_total", "specserve:budget_tokens"):
        assert value(s, name) == 0, name
    for name in BOUNDS:
        assert value(s, f"{name}_count") == 0 and value(s, f"{name}_sum") == 0, name
        assert all(count == 0 for _, count in buckets(s, name)), name
    for reason in ("stop", "length", "abort"):
        assert value(s, "vllm:request_success_total", finished_reason=reason) == 0
    # label sets that only calls create have no series yet
    present = {n for n, _ in s}
    for name in ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "specserve:request_slo_total",
                 "specserve:request_ttft_seconds_count", "specserve:request_tpot_seconds_count",
                 "specserve:request_errors_total", "specserve:replica_up", "specserve:replica_running",
                 "specserve:replica_kv_usage_perc", "specserve:admission_total"):
        assert name not in present, name


def test_primed_tiers_have_zero_series_of_every_labelled_counter_and_histogram():
    m = GatewayMetrics(MODEL)
    m.prime_tiers(["critical", "chat"])
    s = parse(m.render())
    for tier in ("critical", "chat"):
        for outcome in ("declined", "best_effort", "refused"):
            assert value(s, "specserve:admission_total", tier=tier, outcome=outcome) == 0, (tier, outcome)
        for met in ("true", "false"):
            assert value(s, "specserve:request_slo_total", tier=tier, met=met) == 0, (tier, met)
        for name in ("specserve:request_ttft_seconds", "specserve:request_tpot_seconds"):
            assert value(s, f"{name}_count", tier=tier) == 0 and value(s, f"{name}_sum", tier=tier) == 0, name
            assert buckets(s, name, tier=tier) and all(n == 0 for _, n in buckets(s, name, tier=tier)), name
    assert {dict(ls)["tier"] for n, ls in s if n == "specserve:request_slo_total"} == {"critical", "chat"}
    m.on_admission("refused", {"chat": 2})
    m.on_finished("stop", 4, 8, 1.0, 0.1, "chat", True, ttft_s=0.2)
    s = parse(m.render())
    assert value(s, "specserve:admission_total", tier="chat", outcome="refused") == 2
    assert value(s, "specserve:request_slo_total", tier="chat", met="true") == 1
    assert value(s, "specserve:request_slo_total", tier="chat", met="false") == 0
    assert value(s, "specserve:request_ttft_seconds_count", tier="chat") == 1


# ------------------------------------------------------------------------------------------------ values
def test_values_after_a_known_sequence():
    m = GatewayMetrics(MODEL)
    drive(m)
    s = parse(m.render())

    assert value(s, "vllm:num_requests_running") == 2
    assert value(s, "vllm:num_requests_waiting") == 5
    assert value(s, "vllm:kv_cache_usage_perc") == 0.375
    assert value(s, "specserve:budget_tokens") == 24
    assert value(s, "specserve:requests_received_total") == 3
    assert value(s, "vllm:prompt_tokens_total") == 47
    assert value(s, "vllm:generation_tokens_total") == 12
    assert value(s, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(s, "vllm:request_success_total", finished_reason="length") == 1
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(s, "vllm:num_preemptions_total") == 3
    assert value(s, "vllm:prefix_cache_queries_total") == 64 and value(s, "vllm:prefix_cache_hits_total") == 48
    assert value(s, "specserve:request_errors_total", code="too_large") == 2
    assert value(s, "specserve:request_errors_total", code="bad_request") == 1
    assert value(s, "specserve:admission_total", tier="chat", outcome="refused") == 2
    assert value(s, "specserve:admission_total", tier="urgent", outcome="best_effort") == 1
    assert value(s, "specserve:request_slo_total", tier="chat", met="true") == 1
    assert value(s, "specserve:request_slo_total", tier="urgent", met="false") == 1
    slo = {dict(ls)["tier"] + "/" + dict(ls)["met"] for n, ls in s if n == "specserve:request_slo_total"}
    assert slo == {"chat/true", "urgent/false"}  # slo_met=None counts nothing
    assert value(s, "specserve:request_ttft_seconds_sum", tier="chat") == pytest.approx(0.25)
    assert value(s, "specserve:request_ttft_seconds_count", tier="urgent") == 1
    assert value(s, "specserve:request_tpot_seconds_sum", tier="chat") == pytest.approx(0.15)  # 0.05 + 0.1
    assert value(s, "specserve:request_tpot_seconds_count", tier="chat") == 2
    assert ("specserve:request_tpot_seconds_count", frozenset({("model_name", MODEL), ("tier", "urgent")})) not in s

    assert value(s, "vllm:request_queue_time_seconds_count") == 2
    assert value(s, "vllm:request_queue_time_seconds_sum") == pytest.approx(1.4)
    assert buckets(s, "vllm:request_queue_time_seconds")[:5] == [(0.3, 1), (0.5, 1), (0.8, 1), (1.0, 1), (1.5, 2)]
    assert value(s, "vllm:time_to_first_token_seconds_count") == 1
    assert value(s, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.03)
    assert dict(buckets(s, "vllm:time_to_first_token_seconds"))[0.02] == 0
    assert dict(buckets(s, "vllm:time_to_first_token_seconds"))[0.04] == 1

    assert value(s, "vllm:request_time_per_output_token_seconds_count") == 2  # None is not observed
    assert value(s, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.15)
    assert value(s, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(s, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(3.3)
    e2e = dict(buckets(s, "vllm:e2e_request_latency_seconds"))
    assert e2e[0.3] == 0 and e2e[0.5] == 1 and e2e[1.0] == 2 and e2e[2.0] == 3 and e2e[math.inf] == 3

    iters = dict(buckets(s, "vllm:iteration_tokens_total"))
    assert iters[1.0] == 0 and iters[8.0] == 1 and iters[32.0] == 1 and iters[64.0] == 2
    assert value(s, "vllm:iteration_tokens_total_sum") == 47
    assert value(s, "vllm:iteration_tokens_total_count") == 2
    assert value(s, "specserve:iterations_total") == 2
    assert value(s, "specserve:iteration_draft_seconds_total") == pytest.approx(0.010)
    assert value(s, "specserve:iteration_target_seconds_total") == pytest.approx(0.035)
    assert value(s, "specserve:iteration_transport_seconds_total") == pytest.approx(0.004)
    assert value(s, "specserve:iteration_schedule_seconds_total") == pytest.approx(0.003)
    assert value(s, "specserve:draft_catchup_seconds_total") == pytest.approx(0.003)
    assert value(s, "specserve:draft_beam_seconds_total") == pytest.approx(0.006)
    assert value(s, "specserve:draft_sync_seconds_total") == pytest.approx(0.0005)
    assert value(s, "specserve:iteration_pass_seconds_total") == pytest.approx(0.0295)
    assert value(s, "vllm:spec_decode_num_drafts_total") == 4
    assert value(s, "vllm:spec_decode_num_draft_tokens_total") == 16
    assert value(s, "vllm:spec_decode_num_accepted_tokens_total") == 6
    assert value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=0) == 4
    assert value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=1) == 2
    assert value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=2) == 0

    assert value(s, "specserve:replica_up", replica="r0") == 1
    assert value(s, "specserve:replica_running", replica="r0") == 3
    assert value(s, "specserve:replica_kv_usage_perc", replica="r0") == 0.5
    assert value(s, "specserve:replica_up", replica="r1") == 0
    assert value(s, "specserve:replica_running", replica="r1") == 0

    # every histogram series is cumulative, ends in +Inf, and its +Inf bucket equals its count
    for name in BOUNDS:
        bs = buckets(s, name)
        assert bs[-1][0] == math.inf, name
        assert all(a[1] <= b[1] for a, b in zip(bs, bs[1:])), name
        assert bs[-1][1] == value(s, f"{name}_count"), name


def test_gauges_are_set_not_added():
    m = GatewayMetrics(MODEL)
    m.set_load(running=4, waiting=1, kv_usage=0.9)
    m.set_load(running=1, waiting=0, kv_usage=0.25)
    m.set_budget(32)
    m.set_budget(16)
    m.set_replica("a", up=True, running=7, kv_usage=0.75)
    m.set_replica("a", up=False, running=2, kv_usage=0.125)
    s = parse(m.render())
    assert value(s, "vllm:num_requests_running") == 1 and value(s, "vllm:num_requests_waiting") == 0
    assert value(s, "vllm:kv_cache_usage_perc") == 0.25
    assert value(s, "specserve:budget_tokens") == 16
    assert value(s, "specserve:replica_up", replica="a") == 0
    assert value(s, "specserve:replica_running", replica="a") == 2
    assert value(s, "specserve:replica_kv_usage_perc", replica="a") == 0.125


def test_itl_chunk_of_count_tokens_gives_count_observations_of_the_gap_over_count():
    m = GatewayMetrics(MODEL)
    m.on_tokens(5, 0.5)  # 5 observations of 0.1 s
    s = parse(m.render())
    assert value(s, "vllm:inter_token_latency_seconds_count") == 5
    assert value(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.5)
    itl = dict(buckets(s, "vllm:inter_token_latency_seconds"))
    assert itl[0.075] == 0 and itl[0.1] == 5  # 0.1 itself lands in le="0.1" (le is inclusive)
    m.on_tokens(1, 0.5)  # one observation of 0.5 s
    m.on_tokens(0, 3.0)  # no tokens: nothing
    m.on_tokens(-1, 3.0)
    s = parse(m.render())
    itl = dict(buckets(s, "vllm:inter_token_latency_seconds"))
    assert value(s, "vllm:inter_token_latency_seconds_count") == 6
    assert value(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(1.0)
    assert itl[0.4] == 5 and itl[0.5] == 6 and itl[math.inf] == 6


def test_itl_histogram_renders_as_prometheus_clients_histogram_would():
    """The ITL histogram is plain counts on the hot path (metrics._TokenHistogram); its lines in the
    exposition are those of a prometheus_client Histogram given the same samples one token at a time:
    values on every bound (le is inclusive), above the last, zero, chunks of several tokens."""
    m = GatewayMetrics(MODEL)
    registry = prometheus_client.CollectorRegistry()
    ref = prometheus_client.Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                      "seconds.", M, registry=registry, buckets=TOKEN_LATENCY_BUCKETS)
    series = ref.labels(model_name=MODEL)
    rng = random.Random(0)
    chunks = [(1, b) for b in TOKEN_LATENCY_BUCKETS] + [(2, 2 * b) for b in TOKEN_LATENCY_BUCKETS]
    chunks += [(1, 0.0), (1, 81.0), (4, 1000.0), (3, 0.3)]
    chunks += [(rng.randint(1, 6), rng.uniform(0.0, 3.0)) for _ in range(300)]
    for count, gap in chunks:
        m.on_tokens(count, gap)
        for _ in range(count):
            series.observe(gap / count)

    def lines(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if "vllm:inter_token_latency_seconds" in ln and "_created" not in ln
                and "_sum" not in ln]

    want = exposition.generate_latest(registry).decode()
    assert lines(m.render()) == lines(want)
    got, ref_samples = parse(m.render()), parse(want)
    assert value(got, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
        ref_samples[("vllm:inter_token_latency_seconds_sum", frozenset({"model_name": MODEL}.items()))], rel=1e-12)


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    m = GatewayMetrics(MODEL)
    for v in (0.0005, 0.001, 0.003, 0.005, 0.7, 3000.0):  # 3000 is above the last bound, 2560
        m.on_first_token(v)
    s = parse(m.render())
    ttft = buckets(s, "vllm:time_to_first_token_seconds")
    assert ttft[:4] == [(0.001, 2), (0.005, 4), (0.01, 4), (0.02, 4)]
    assert dict(ttft)[0.75] == 5 and dict(ttft)[2560.0] == 5 and dict(ttft)[math.inf] == 6
    assert value(s, "vllm:time_to_first_token_seconds_count") == 6
    assert value(s, "vllm:time_to_first_token_seconds_sum") == pytest.approx(3000.7095)


# ------------------------------------------------------------------------------------------------ exposition
def test_model_name_label_is_escaped():
    odd = 'org/"model"\\v1\nx'
    m = GatewayMetrics(odd)
    m.on_queued()
    m.on_error('say "no"')
    text = m.render()
    # as written on the line: backslash, double quote and line feed escaped
    assert 'specserve:requests_received_total{model_name="org/\\"model\\"\\\\v1\\nx"} 1.0' in text.splitlines()
    s = parse(text)
    assert value(s, "specserve:requests_received_total", model=odd) == 1
    assert value(s, "specserve:request_errors_total", model=odd, code='say "no"') == 1
    assert value(s, "vllm:request_success_total", model=odd, finished_reason="abort") == 0


def test_instances_do_not_share_state():
    a, b = GatewayMetrics(MODEL), GatewayMetrics(MODEL)  # same model name, same metric names, one process
    assert a.registry is not b.registry and a.registry is not prometheus_client.REGISTRY
    a.on_queued()
    a.on_iteration(sample_records()[1])
    a.set_budget(8)
    sa, sb = parse(a.render()), parse(b.render())
    assert value(sa, "specserve:requests_received_total") == 1 and value(sb, "specserve:requests_received_total") == 0
    assert value(sa, "specserve:iterations_total") == 1 and value(sb, "specserve:iterations_total") == 0
    assert value(sa, "specserve:budget_tokens") == 8 and value(sb, "specserve:budget_tokens") == 0
    assert ("vllm:spec_decode_num_accepted_tokens_per_pos_total" in {n for n, _ in sa}
            and "vllm:spec_decode_num_accepted_tokens_per_pos_total" not in {n for n, _ in sb})
    # nothing lands in the process-global default registry
    assert prometheus_client.REGISTRY.get_sample_value("specserve:requests_received_total",
                                                       {"model_name": MODEL}) is None


def test_no_created_samples():
    m = GatewayMetrics(MODEL)
    drive(m)
    text = m.render()
    assert "_created" not in text
    assert not [n for n, _ in parse(text) if n.endswith("_created")]
    # ... though the registry itself has them (the rendering drops them, per registry, not process-wide)
    assert "_created" in exposition.generate_latest(m.registry).decode()


def test_content_type_is_the_text_format_generate_latest_writes():
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    # the library's name for it (newer releases; in older ones CONTENT_TYPE_LATEST was this same string)
    assert CONTENT_TYPE == getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST)
    # what the library serves a scraper that asks for nothing in particular: generate_latest, with this type
    encoder, content_type = exposition.choose_encoder("")
    assert encoder is exposition.generate_latest and content_type == CONTENT_TYPE
    m = GatewayMetrics(MODEL)
    drive(m)
    raw = exposition.generate_latest(m.registry).decode()
    assert m.render() == "".join(line + "\n" for line in raw.splitlines() if "_created" not in line)


def test_registry_rejects_a_second_gateway_metrics():
    registry = prometheus_client.CollectorRegistry()
    GatewayMetrics(MODEL, registry)
    with pytest.raises(ValueError):
        GatewayMetrics("other", registry)  # same names in one registry


def test_a_dropped_replica_has_no_series():
    """A replica that left the set (discovery) is removed, not left at up=0 (the replica-down alert)."""
    m = GatewayMetrics(MODEL)
    drive(m)
    m.drop_replica("r1")
    m.drop_replica("never-seen")  # nothing to remove
    s = parse(m.render())
    assert value(s, "specserve:replica_up", replica="r0") == 1
    assert not [n for n, ls in s if dict(ls).get("replica") == "r1"]
    m.set_replica("r1", up=True, running=1, kv_usage=0.25)  # an address that comes back
    assert value(parse(m.render()), "specserve:replica_up", replica="r1") == 1
