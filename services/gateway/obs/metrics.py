"""Prometheus metrics of the gateway, kept in a `prometheus_client` registry and rendered in the text
exposition format 0.0.4.

`GatewayMetrics` defines the metric names dashboards built for vLLM already query (every one labelled
with `model_name`, as vLLM does), plus specserve's own (`specserve:` prefix), and the engine-facing
calls that feed them. Each instance has its own `CollectorRegistry` (never the process-global default
one), so several can live in one process.

Counters are declared without their `_total` suffix: prometheus_client appends it, and renders
`# TYPE vllm:prompt_tokens_total counter` in the 0.0.4 format. The `_created` series prometheus_client
adds to counters and histograms are left out of the rendering (vLLM's dashboards do not use them).
"""

from __future__ import annotations

import copy
from bisect import bisect_left
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from specserve.gateway.perf.record import IterationRecord

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

# The /metrics response's Content-Type: the text format 0.0.4, which is what `generate_latest` writes
# (= prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4, which `choose_encoder` pairs with
# `generate_latest` when a scraper asks for nothing else; older releases lack that name and call it
# CONTENT_TYPE_LATEST). Not CONTENT_TYPE_LATEST itself: in recent releases (0.26 here) that announces
# version=1.0.0, the UTF-8-names text format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Families of these types get a `<name>_created` sample from prometheus_client; it is dropped.
_CREATED_TYPES = ("counter", "histogram", "summary", "gaugehistogram")


class _WithoutCreated:
    """A view of a registry that yields its families without their `_created` samples.

    Per registry, unlike `prometheus_client.disable_created_metrics()` (process-global state that
    other users of the library in the same process would also see) or the
    PROMETHEUS_DISABLE_CREATED_SERIES environment variable."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            if family.type in _CREATED_TYPES:
                created = family.name + "_created"
                family = copy.copy(family)
                family.samples = [s for s in family.samples if s.name != created]
            yield family


# Bucket bounds as vLLM (v1) sets them (prometheus_client adds the +Inf bucket).
MODEL = ("model_name",)  # the label every metric has
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)  # inter-token latency and per-request time per output token
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # e2e latency and queue time
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

FINISH_REASONS = ("stop", "length", "abort")  # vLLM's, created at start so dashboards see zeros
ADMISSION_OUTCOMES = ("declined", "best_effort", "refused")  # specserve:admission_total's outcome label
SLO_MET = ("true", "false")  # specserve:request_slo_total's met label


class _TokenHistogram:
    """One histogram series observed once per streamed chunk (the inter-token latency), kept as plain
    numbers and turned into a histogram family when the registry is collected. prometheus_client's
    `Histogram.observe` takes a lock and scans the bucket bounds one by one (some 6 us a sample, a
    thousand samples an iteration at 1,000 streams); here a sample is one bisection, and the `count`
    equal samples of a speculative step are added at once. Same exposition: `_bucket` (cumulative,
    `le` as prometheus_client writes it), `_count`, `_sum`."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str):
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = list(buckets)  # the +Inf bucket is the last count
        self.les = [*map(floatToGoString, buckets), "+Inf"]
        self.counts = [0] * (len(buckets) + 1)  # per bucket (not cumulative)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` samples of `value` (the first bucket whose bound is >= value, as prometheus_client)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, total = [], 0
        for le, n in zip(self.les, self.counts):
            total += n
            cumulative.append((le, total))
        family.add_metric([self.model_name], cumulative, self.sum)
        yield family


class _IterationCounters:
    """The counters every engine iteration adds to, kept as plain numbers (no lock, no label lookup on
    the hot path) and turned into counter families when the registry is collected (a scrape)."""

    SECONDS = (  # (name, help), in the order of the parts `add` sums
        ("specserve:iteration_draft_seconds", "Seconds the draft service spent in speculation calls (inside the "
         "service)."),
        ("specserve:iteration_target_seconds", "Seconds the target service spent in forward calls (inside the "
         "service)."),
        ("specserve:iteration_transport_seconds", "Seconds of draft and target calls spent outside the services "
         "(serialization, sockets, waiting for the reply)."),
        ("specserve:iteration_schedule_seconds", "Seconds of iterations outside service calls: admission, policy, "
         "node selection, commit, streaming."),
        ("specserve:draft_catchup_seconds", "Seconds the draft spent appending committed tokens to its KV "
         "(catch-up), inside Speculate calls on the critical path."),
        ("specserve:draft_beam_seconds", "Seconds the draft spent in beam steps, inside Speculate calls."),
        ("specserve:draft_sync_seconds", "Seconds the draft spent in calls beside the target pass (eager syncs, "
         "drafting ahead)."),
        ("specserve:iteration_pass_seconds", "Seconds of the target's model pass alone (a part of the target "
         "service's seconds)."),
    )
    COUNTS = (  # (name, help)
        ("specserve:iterations", "Engine iterations run."),
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
        ("specserve:draft_ahead", "Trees drafted ahead beside the target pass (--overlap)."),
        ("specserve:draft_ahead_hits", "Trees drafted ahead whose guess the target's answer matched (used next "
         "step)."),
        ("specserve:passes_sent_ahead", "Target passes sent before the replica's previous pass was committed "
         "(--async-scheduling)."),
        ("specserve:chains_sent_ahead", "Chains sent one step ahead, drafted on a guess of the answer in flight "
         "(--async-scheduling)."),
        ("specserve:chains_sent_ahead_hits", "Chains sent ahead whose guess the answer matched (verified as "
         "drafted; the others verified their root alone)."),
    )
    PER_POSITION = ("vllm:spec_decode_num_accepted_tokens_per_pos",
                    "Accepted tokens per draft position (0 = first draft token).")

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.seconds = [0.0] * len(self.SECONDS)
        # iterations, drafts, draft tokens, accepted, ahead, hits, sent ahead, chains sent ahead, their hits
        self.counts = [0] * len(self.COUNTS)
        self.per_position: list[int] = []  # accepted draft tokens per position, summed over iterations

    def add(self, record: IterationRecord) -> None:
        parts = (record.draft_ms, record.target_ms, record.transport_ms, record.schedule_ms,
                 record.draft.catchup_ms, record.draft.beam_ms, record.draft.sync_service_ms, record.pass_ms)
        for i, ms in enumerate(parts):
            self.seconds[i] += ms / 1e3
        counts = self.counts
        counts[0] += 1
        counts[4] += record.draft.ahead
        counts[5] += record.draft.ahead_hits
        counts[6] += record.sent_ahead
        counts[7] += record.draft.guessed
        counts[8] += record.draft.guess_hits
        per_position = self.per_position
        for step in record.requests:
            if step.verified > 1 and step.error is None:
                counts[1] += 1
                counts[2] += step.verified - 1
                counts[3] += step.accepted
                if len(per_position) < step.verified - 1:
                    per_position += [0] * (step.verified - 1 - len(per_position))
                for position in range(step.accepted):
                    per_position[position] += 1

    def collect(self) -> Iterable[Metric]:
        """In the exposition's order: vLLM's speculation counters, then specserve's iteration split."""
        labels = [self.model_name]

        def family(name: str, doc: str, value: float) -> CounterMetricFamily:
            f = CounterMetricFamily(name, doc, labels=["model_name"])
            f.add_metric(labels, value)
            return f

        for (name, doc), count in zip(self.COUNTS[1:4], self.counts[1:4]):
            yield family(name, doc, count)
        per_position = CounterMetricFamily(*self.PER_POSITION, labels=["model_name", "position"])
        for position, count in enumerate(self.per_position):
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position
        for (name, doc), value in zip(self.SECONDS[:4], self.seconds[:4]):
            yield family(name, doc, value)
        yield family(*self.COUNTS[0], self.counts[0])
        for (name, doc), value in zip(self.SECONDS[4:], self.seconds[4:]):
            yield family(name, doc, value)
        for (name, doc), count in zip(self.COUNTS[4:], self.counts[4:]):  # drafting ahead, passes sent ahead
            yield family(name, doc, count)


class GatewayMetrics:
    """Every metric the gateway exports, and the calls the engine makes to feed them (seconds throughout).

    Conventions:
    - prompt and generation token counters grow when a request finishes (`on_finished`), from its
      final counts; vLLM adds them per iteration, the totals agree once requests have finished;
    - `on_tokens(count, itl_s)`: a chunk of `count` tokens arrived `itl_s` after the previous chunk
      of the same request. A speculative step emits several tokens at once, so the inter-token
      latency histogram gets `count` observations of `itl_s / count` (one per token, as vLLM's
      per-token samples; its sum grows by exactly `itl_s`);
    - `on_queued` counts requests received (`specserve:requests_received_total`); the running and
      waiting gauges come only from `set_load`, so they have one source of truth;
    - `set_replica` feeds the per-replica gauges of a gateway in front of several replicas
      (labelled `replica`, no series until it is first called).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._vllm_metrics()
        self._specserve_metrics()
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name=model_name, finished_reason=reason)
        self._exposed = _WithoutCreated(self.registry)
        self._replicas: dict[str, tuple[Gauge, Gauge, Gauge]] = {}  # per replica: up, running, KV usage

    # A metric labelled by model_name alone is kept as its one series (bound once here, so that the hot
    # path does no label lookup; binding also creates the series, so dashboards see zeros).
    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = MODEL) -> Counter:
        family = Counter(name.removesuffix("_total"), doc, labels, registry=self.registry)  # the client adds _total
        return family.labels(model_name=self.model_name) if labels == MODEL else family

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = MODEL) -> Gauge:
        family = Gauge(name, doc, labels, registry=self.registry)
        return family.labels(model_name=self.model_name) if labels == MODEL else family

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, MODEL, registry=self.registry, buckets=buckets).labels(model_name=self.model_name)

    def _vllm_metrics(self) -> None:
        """vLLM's metrics, under its names: scheduler state, token and request counters, latency histograms."""
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        # ---- vLLM: scheduler state
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # ---- vLLM: counters
        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens_total", "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success_total", "Count of successfully processed requests.",
                                       (*MODEL, "finished_reason"))
        self.preemptions = counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.")  # every prompt token, once, as its chunk is prefilled
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # ---- vLLM: histograms
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = _TokenHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                   TOKEN_LATENCY_BUCKETS, self.model_name)
        self.registry.register(self.itl)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        # a histogram whose name ends in _total, as vLLM's (only counters get _total appended)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)

    def _specserve_metrics(self) -> None:
        """specserve's own: the per-iteration counters, requests and SLOs by tier, admission, per replica."""
        counter, gauge, r = self._counter, self._gauge, self.registry
        # ---- the counters every iteration adds to (vLLM's speculative decoding counters and specserve's
        # iteration split): plain numbers on the hot path, turned into samples when /metrics is read
        self.per_iteration = _IterationCounters(self.model_name)
        r.register(self.per_iteration)
        self.requests_received = counter("specserve:requests_received_total", "Requests received (queued).")
        self.requests_moved = counter("specserve:requests_moved_total", "Requests moved off a target replica that "
                                      "was lost, to resume on another by recompute.")
        self.slo = counter("specserve:request_slo_total",
                           "Finished requests by SLO tier and whether the SLO was met.", (*MODEL, "tier", "met"))
        # per SLO tier (the dashboard's p50/p99 per tier): observed when a request finishes
        self.tier_ttft = Histogram("specserve:request_ttft_seconds", "Time to first token of finished requests, "
                                   "by SLO tier, seconds.", (*MODEL, "tier"), registry=r, buckets=TTFT_BUCKETS)
        self.tier_tpot = Histogram("specserve:request_tpot_seconds", "Time per output token of finished requests "
                                   "(after the first), by SLO tier, seconds.", (*MODEL, "tier"), registry=r,
                                   buckets=TOKEN_LATENCY_BUCKETS)
        self.budget = gauge("specserve:budget_tokens", "Token budget B of one target pass (roots included).")
        self.errors = counter("specserve:request_errors_total", "Requests that ended in an error, by code.",
                              (*MODEL, "code"))
        self.admission = counter("specserve:admission_total",
                                 "SLO-aware admission outcomes by tier: declined (a replica's planner said no), "
                                 "best_effort (admitted without an SLO) and refused (503); "
                                 "zero under --admission fifo.",
                                 (*MODEL, "tier", "outcome"))
        # ---- specserve: per replica, for a gateway in front of several
        self.replica_up = gauge("specserve:replica_up", "Whether the replica is up (1) or not (0).",
                                (*MODEL, "replica"))
        self.replica_running = gauge("specserve:replica_running", "Requests running on the replica.",
                                     (*MODEL, "replica"))
        self.replica_kv_usage = gauge("specserve:replica_kv_usage_perc",
                                      "KV-cache usage of the replica. 1 means 100 percent usage.", (*MODEL, "replica"))

    # ---- request lifecycle -------------------------------------------------------------------
    def on_queued(self) -> None:
        self.requests_received.inc()

    def on_admitted(self, queue_s: float) -> None:
        self.queue_time.observe(queue_s)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_tokens(self, count: int, itl_s: float) -> None:
        """A chunk of `count` tokens, `itl_s` after the request's previous chunk: `count` ITL samples of
        `itl_s / count` each."""
        if count <= 0:
            return
        self.itl.observe(itl_s / count, count)

    def on_finished(self, reason: str, prompt_tokens: int, generation_tokens: int, e2e_s: float,
                    tpot_s: float | None, tier: str, slo_met: bool | None, ttft_s: float | None = None) -> None:
        """tpot_s is None for a request with fewer than two output tokens, ttft_s for one with none;
        slo_met is None when the request has no SLO to judge (nothing is counted in
        specserve:request_slo_total then)."""
        name = self.model_name
        self.request_success.labels(model_name=name, finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
            self.tier_tpot.labels(model_name=name, tier=tier).observe(tpot_s)
        if ttft_s is not None:
            self.tier_ttft.labels(model_name=name, tier=tier).observe(ttft_s)
        if slo_met is not None:
            self.slo.labels(model_name=name, tier=tier, met="true" if slo_met else "false").inc()

    def on_error(self, code: str) -> None:
        self.errors.labels(model_name=self.model_name, code=code).inc()

    def prime_tiers(self, tiers: Iterable[str]) -> None:
        """Zero series of every SLO tier's labelled counters and histograms, created at start so that
        dashboards and `rate()` see each tier before its first event: specserve:admission_total per
        (tier, outcome), specserve:request_slo_total per (tier, met) and the per-tier TTFT and TPOT
        histograms. (A tier that is not known up front, a request's own `custom` SLO, gets its series
        when it first finishes.)"""
        name = self.model_name
        for tier in tiers:
            for outcome in ADMISSION_OUTCOMES:
                self.admission.labels(model_name=name, tier=tier, outcome=outcome)
            for met in SLO_MET:
                self.slo.labels(model_name=name, tier=tier, met=met)
            self.tier_ttft.labels(model_name=name, tier=tier)
            self.tier_tpot.labels(model_name=name, tier=tier)

    def on_admission(self, outcome: str, counts: dict[str, int]) -> None:
        for tier, n in counts.items():
            self.admission.labels(model_name=self.model_name, tier=tier, outcome=outcome).inc(n)

    def on_preempted(self, count: int = 1) -> None:
        self.preemptions.inc(count)

    def on_moved(self, count: int) -> None:
        self.requests_moved.inc(count)

    def on_prefix_cache(self, queried: int, hits: int) -> None:
        """A prompt chunk looked up in its replica's prefix cache (`queried` tokens), `hits` of them found there."""
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hits)

    # ---- engine iterations -------------------------------------------------------------------
    def on_iteration(self, record: IterationRecord) -> None:
        """One engine iteration, from its record: the tokens of its target passes (prompt chunks + tree
        nodes, all replicas), the time split (draft and target inside the services, transport,
        scheduling; seconds), the draft's catch-up, beam and eager-sync time, and the speculation
        counts: requests that verified draft tokens, draft (non-root) nodes verified, how many were
        accepted, and the accepted count per depth (position 0 = depth 1)."""
        self.iteration_tokens.observe(record.prefill_tokens + record.tree_nodes)
        self.per_iteration.add(record)

    # ---- state -------------------------------------------------------------------------------
    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def set_budget(self, tokens: int) -> None:
        self.budget.set(tokens)

    def set_replica(self, replica: str, up: bool, running: int, kv_usage: float) -> None:
        """The state of one replica behind the gateway: up or not, its running requests, its KV-cache
        usage (0-1)."""
        series = self._replicas.get(replica)
        if series is None:
            labels = {"model_name": self.model_name, "replica": replica}
            series = self._replicas[replica] = (self.replica_up.labels(**labels),
                                                self.replica_running.labels(**labels),
                                                self.replica_kv_usage.labels(**labels))
        series[0].set(1 if up else 0)
        series[1].set(running)
        series[2].set(kv_usage)

    def drop_replica(self, replica: str) -> None:
        """A replica that left the set (discovery.py): its series are removed, not left at 0 (an alert on
        specserve:replica_up == 0 is for replicas the gateway still counts on)."""
        if self._replicas.pop(replica, None) is not None:
            labels = (self.model_name, replica)
            for family in (self.replica_up, self.replica_running, self.replica_kv_usage):
                family.remove(*labels)

    def render(self) -> str:
        """The text exposition (format 0.0.4, see CONTENT_TYPE), without `_created` samples."""
        return generate_latest(self._exposed).decode("utf-8")
