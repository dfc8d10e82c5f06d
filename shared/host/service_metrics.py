"""Prometheus metrics of a draft or target service, on a small HTTP port of its own (`--metrics-port`).

- `specserve:service_call_seconds{service, call}`: a histogram of the time each model call
  (`Forward`, `Speculate`, `Release`, `Offload`, `Reload`) spent on the model thread: the pass time;
- `specserve:service_kv_blocks_used` / `specserve:service_kv_blocks_total{service}`: its KV pool (blocks its
  requests hold); `specserve:service_kv_blocks_cached{service}`: blocks holding a prefix-cache entry,
  held or evictable (the evictable ones are free for allocation);
- `specserve:service_requests{service}`: requests it holds state for;
- `specserve:service_offloaded{service}`: 1 while a draft's weights are in host memory;
- `specserve:service_calls_total` / `specserve:service_entry_errors_total{service}`: from its Stats;
- `specserve:service_asyncio_tasks{service}`: the tasks alive on its event loop (shared/process/loop_tasks.py).

The gauges and counters are read from the service's own `Stats` reply at scrape time, so they are
never stale and cost nothing between scrapes. The server is prometheus_client's (a daemon thread);
it starts once the model is loaded and the RPC socket listens, so an answer on this port also
means "ready" (the compose health checks use it). Each service has its own registry.

The server is a small `http.server` on a daemon thread that always answers in the text format
0.0.4, as the gateway does (services/gateway/obs/metrics.py): prometheus_client's own server would
answer Prometheus's Accept header with OpenMetrics 1.0 and escape the `:` of every name to `_`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from specserve.shared.process.loop_tasks import LoopTasks
from specserve.shared.wire.messages import Message, StatsReply

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format generate_latest writes
# Model calls take from well under a millisecond (a small release) to seconds (a long prefill on CPU).
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _StatsCollector:
    def __init__(self, name: str, stats: Callable[[], Message]):
        self.name, self.stats = name, stats

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        if not isinstance(s, StatsReply):
            return
        labels = [self.name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            f = GaugeMetricFamily(metric, doc, labels=["service"])
            f.add_metric(labels, value)
            return f

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            f = CounterMetricFamily(metric, doc, labels=["service"])
            f.add_metric(labels, value)
            return f

        yield gauge("specserve:service_kv_blocks_used", "KV blocks in use.", s.used_blocks)
        yield gauge("specserve:service_kv_blocks_total", "KV pool size, blocks (0 while a draft is offloaded).",
                    s.total_blocks)
        yield gauge("specserve:service_kv_blocks_cached", "KV blocks holding a prefix-cache entry (in use, or "
                    "evictable: free for allocation).", s.cached_blocks)
        yield gauge("specserve:service_requests", "Requests the service holds state for.", s.resident_requests)
        yield gauge("specserve:service_offloaded", "1 while the draft's weights are in host memory.",
                    float(s.offloaded))
        yield counter("specserve:service_calls", "Calls served since start.", s.calls)
        yield counter("specserve:service_entry_errors", "Entries refused since start.", s.entry_errors)


class ServiceMetrics:
    def __init__(self, name: str, stats: Callable[[], Message]):
        self.name = name
        self.registry = CollectorRegistry(auto_describe=False)
        self.calls = Histogram("specserve:service_call_seconds", "Seconds a model call spent on the model thread.",
                               ["service", "call"], buckets=CALL_BUCKETS, registry=self.registry)
        self.registry.register(_StatsCollector(name, stats))

    def timed(self, handler: Callable[..., Any], call: str) -> Callable[..., Any]:
        """The handler, observing the time of each call into the histogram."""
        series = self.calls.labels(self.name, call)

        def run(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return handler(*args)
            finally:
                series.observe(time.perf_counter() - t0)

        return run

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        """Start the HTTP server (a daemon thread) on host:port: GET /metrics; anything else is 404. Called on
        the service's event loop, whose live tasks it then also serves."""
        registry = self.registry
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            registry.register(LoopTasks("specserve:service_asyncio_tasks", "Tasks alive on the service's event loop.",
                                        {"service": self.name}, loop, threadsafe=True))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (scrapes are not logged)
                pass

        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name=f"{self.name}-metrics", daemon=True).start()
        return server
