"""Prometheus metrics of the gateway, rendered in the text exposition format 0.0.4 (no client library).

`Registry` holds counters, gauges and histograms and renders them; `GatewayMetrics` defines the
metric names dashboards built for vLLM already query (every one labelled with `model_name`, as
vLLM does), plus specserve's own (`specserve:` prefix), and the engine-facing calls that feed them.

Names are rendered exactly as given: counters carry their `_total` suffix in the name, as the
Prometheus Python client renders them in the 0.0.4 format (`# TYPE vllm:prompt_tokens_total counter`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

__all__ = ["CONTENT_TYPE", "Counter", "Gauge", "GatewayMetrics", "Histogram", "Registry"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the /metrics response's Content-Type

LabelKey = tuple[str, ...]  # label values in labelnames order


def format_value(value: float) -> str:
    """A sample value or bucket bound as Prometheus writes it: 1.0, 0.25, +Inf, -Inf, NaN."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def escape_label_value(value: str) -> str:
    """Label values escape backslash, double quote and line feed."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """HELP text escapes backslash and line feed."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels_text(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{escape_label_value(v)}"' for n, v in zip(names, values)) + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Iterable[str] = (), lock: threading.Lock | None = None):
        self.name, self.help = name, help
        self.labelnames = tuple(labelnames)
        if "le" in self.labelnames and self.kind == "histogram":
            raise ValueError("'le' is reserved for histogram buckets")
        self._lock = lock or threading.Lock()

    def _key(self, labels: dict[str, object]) -> LabelKey:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {list(self.labelnames)}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def touch(self, **labels: object) -> None:
        """Create the series for these label values (rendered with zero values until used)."""
        raise NotImplementedError

    def samples(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> list[str]:
        with self._lock:
            body = self.samples()
        return [f"# HELP {self.name} {escape_help(self.help)}", f"# TYPE {self.name} {self.kind}", *body]


class _Scalar(_Metric):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._values: dict[LabelKey, float] = {} if self.labelnames else {(): 0.0}

    def touch(self, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values.setdefault(key, 0.0)

    def value(self, **labels: object) -> float:
        """The current value of one series (0 if it was never touched)."""
        key = self._key(labels)
        with self._lock:
            return self._values.get(key, 0.0)

    def samples(self) -> list[str]:
        return [f"{self.name}{_labels_text(self.labelnames, key)} {format_value(v)}"
                for key, v in self._values.items()]


class Counter(_Scalar):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Scalar):
    kind = "gauge"

    def set(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Iterable[float], labelnames: Iterable[str] = (),
                 lock: threading.Lock | None = None):
        super().__init__(name, help, labelnames, lock)
        bounds = [float(b) for b in buckets]
        if any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise ValueError(f"{name}: buckets must increase strictly, got {bounds}")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        # per series: [per-bucket counts (not cumulative), sum]
        self._series: dict[LabelKey, tuple[list[int], list[float]]] = {}
        if not self.labelnames:
            self._series[()] = ([0] * len(self.bounds), [0.0])

    def _get(self, key: LabelKey) -> tuple[list[int], list[float]]:
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = ([0] * len(self.bounds), [0.0])
        return series

    def touch(self, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._get(key)

    def observe(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        value = float(value)
        # le is inclusive: a value equal to a bound falls in that bound's bucket
        index = next(i for i, b in enumerate(self.bounds) if value <= b) if not math.isnan(value) else -1
        with self._lock:
            counts, total = self._get(key)
            counts[index] += 1
            total[0] += value

    def samples(self) -> list[str]:
        lines = []
        names = (*self.labelnames, "le")
        for key, (counts, total) in self._series.items():
            cumulative = 0
            for bound, count in zip(self.bounds, counts):
                cumulative += count
                lines.append(f"{self.name}_bucket{_labels_text(names, (*key, format_value(bound)))} {cumulative}")
            labels = _labels_text(self.labelnames, key)
            lines.append(f"{self.name}_sum{labels} {format_value(total[0])}")
            lines.append(f"{self.name}_count{labels} {cumulative}")
        return lines


class Registry:
    """The metrics of one process, rendered in registration order."""

    def __init__(self):
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric):
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Counter:
        return self._add(Counter(name, help, labelnames))

    def gauge(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Gauge:
        return self._add(Gauge(name, help, labelnames))

    def histogram(self, name: str, help: str, buckets: Iterable[float], labelnames: Iterable[str] = ()) -> Histogram:
        return self._add(Histogram(name, help, buckets, labelnames))

    def get(self, name: str) -> _Metric:
        return self._metrics[name]

    def render(self) -> str:
        lines = [line for metric in self._metrics.values() for line in metric.render()]
        return "\n".join(lines) + "\n"


# Bucket bounds as vLLM (v1) sets them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)  # inter-token latency and per-request time per output token
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # e2e latency and queue time
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

FINISH_REASONS = ("stop", "length", "abort")  # vLLM's, created at start so dashboards see zeros


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
      waiting gauges come only from `set_load`, so they have one source of truth.
    """

    def __init__(self, model_name: str, registry: Registry | None = None):
        self.model_name = model_name
        self.registry = r = registry or Registry()
        m = ("model_name",)
        # ---- vLLM: scheduler state
        self.running = r.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", m)
        self.waiting = r.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m)
        self.kv_usage = r.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m)
        # ---- vLLM: counters
        self.prompt_tokens = r.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", m)
        self.generation_tokens = r.counter("vllm:generation_tokens_total", "Number of generation tokens processed.", m)
        self.request_success = r.counter("vllm:request_success_total", "Count of successfully processed requests.",
                                         (*m, "finished_reason"))
        self.preemptions = r.counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
                                     m)
        # ---- vLLM: histograms
        self.ttft = r.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                TTFT_BUCKETS, m)
        self.itl = r.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                               TOKEN_LATENCY_BUCKETS, m)
        self.tpot = r.histogram("vllm:request_time_per_output_token_seconds",
                                "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS, m)
        self.e2e = r.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               REQUEST_LATENCY_BUCKETS, m)
        self.queue_time = r.histogram("vllm:request_queue_time_seconds",
                                      "Histogram of time spent in WAITING phase for request.",
                                      REQUEST_LATENCY_BUCKETS, m)
        self.iteration_tokens = r.histogram("vllm:iteration_tokens_total",
                                            "Histogram of number of tokens per engine_step.",
                                            ITERATION_TOKENS_BUCKETS, m)
        # ---- vLLM: speculative decoding. Recent vLLM versions expose these as counters whose names end
        # in _total (vllm:spec_decode_num_drafts_total, ...); older ones had no suffix.
        self.spec_drafts = r.counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", m)
        self.spec_draft_tokens = r.counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", m)
        self.spec_accepted = r.counter("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", m)
        self.spec_accepted_per_pos = r.counter("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                               "Accepted tokens per draft position (0 = first draft token).",
                                               (*m, "position"))
        # ---- specserve
        self.draft_seconds = r.counter("specserve:iteration_draft_seconds_total",
                                       "Seconds the draft service spent in speculation calls (inside the service).", m)
        self.target_seconds = r.counter("specserve:iteration_target_seconds_total",
                                        "Seconds the target service spent in forward calls (inside the service).", m)
        self.transport_seconds = r.counter("specserve:iteration_transport_seconds_total",
                                           "Seconds of draft and target calls spent outside the services "
                                           "(serialization, sockets, waiting for the reply).", m)
        self.schedule_seconds = r.counter("specserve:iteration_schedule_seconds_total",
                                          "Seconds of iterations outside service calls: admission, policy, "
                                          "node selection, commit, streaming.", m)
        self.iterations = r.counter("specserve:iterations_total", "Engine iterations run.", m)
        self.requests_received = r.counter("specserve:requests_received_total", "Requests received (queued).", m)
        self.slo = r.counter("specserve:request_slo_total",
                             "Finished requests by SLO tier and whether the SLO was met.", (*m, "tier", "met"))
        self.budget = r.gauge("specserve:budget_tokens", "Token budget B of one target pass (roots included).", m)
        self.errors = r.counter("specserve:request_errors_total", "Requests that ended in an error, by code.",
                                (*m, "code"))

        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.preemptions, self.ttft, self.itl, self.tpot, self.e2e, self.queue_time,
                       self.iteration_tokens, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted,
                       self.draft_seconds, self.target_seconds, self.schedule_seconds, self.iterations,
                       self.requests_received, self.budget):
            metric.touch(model_name=model_name)
        for reason in FINISH_REASONS:
            self.request_success.touch(model_name=model_name, finished_reason=reason)

    # ---- request lifecycle -------------------------------------------------------------------
    def on_queued(self) -> None:
        self.requests_received.inc(model_name=self.model_name)

    def on_admitted(self, queue_s: float) -> None:
        self.queue_time.observe(queue_s, model_name=self.model_name)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s, model_name=self.model_name)

    def on_tokens(self, count: int, itl_s: float) -> None:
        """A chunk of `count` tokens, `itl_s` after the request's previous chunk: `count` ITL samples of
        `itl_s / count` each."""
        if count <= 0:
            return
        per_token = itl_s / count
        for _ in range(count):
            self.itl.observe(per_token, model_name=self.model_name)

    def on_finished(self, reason: str, prompt_tokens: int, generation_tokens: int, e2e_s: float,
                    tpot_s: float | None, tier: str, slo_met: bool | None) -> None:
        """tpot_s is None for a request with fewer than two output tokens; slo_met is None when the
        request has no SLO to judge (nothing is counted in specserve:request_slo_total then)."""
        name = self.model_name
        self.request_success.inc(model_name=name, finished_reason=reason)
        self.prompt_tokens.inc(prompt_tokens, model_name=name)
        self.generation_tokens.inc(generation_tokens, model_name=name)
        self.e2e.observe(e2e_s, model_name=name)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, model_name=name)
        if slo_met is not None:
            self.slo.inc(model_name=name, tier=tier, met="true" if slo_met else "false")

    def on_error(self, code: str) -> None:
        self.errors.inc(model_name=self.model_name, code=code)

    def on_preempted(self, count: int = 1) -> None:
        self.preemptions.inc(count, model_name=self.model_name)

    # ---- engine iterations -------------------------------------------------------------------
    def on_iteration(self, tokens: int, draft_s: float, target_s: float, schedule_s: float, drafts: int,
                     draft_tokens: int, accepted: int, accepted_per_pos: list[int], transport_s: float = 0.0) -> None:
        """One engine iteration: `tokens` in the target pass (prefill chunks + tree nodes), the time of its
        phases (draft and target inside the services, transport, scheduling), `drafts` requests that
        verified draft tokens, `draft_tokens` draft (non-root) nodes
        verified, `accepted` of them accepted, and the accepted count per depth (index 0 = depth 1)."""
        name = self.model_name
        self.iteration_tokens.observe(tokens, model_name=name)
        self.draft_seconds.inc(draft_s, model_name=name)
        self.target_seconds.inc(target_s, model_name=name)
        self.transport_seconds.inc(transport_s, model_name=name)
        self.schedule_seconds.inc(schedule_s, model_name=name)
        self.iterations.inc(model_name=name)
        self.spec_drafts.inc(drafts, model_name=name)
        self.spec_draft_tokens.inc(draft_tokens, model_name=name)
        self.spec_accepted.inc(accepted, model_name=name)
        for position, count in enumerate(accepted_per_pos):
            self.spec_accepted_per_pos.inc(count, model_name=name, position=position)

    # ---- state -------------------------------------------------------------------------------
    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        name = self.model_name
        self.running.set(running, model_name=name)
        self.waiting.set(waiting, model_name=name)
        self.kv_usage.set(kv_usage, model_name=name)

    def set_budget(self, tokens: int) -> None:
        self.budget.set(tokens, model_name=self.model_name)

    def render(self) -> str:
        return self.registry.render()
