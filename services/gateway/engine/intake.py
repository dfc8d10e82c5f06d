"""Intake: a request's way into the engine (submit, or a 503 at once) and out of it early (abort).

Submitting checks, in order: a target replica is up; the waiting queue has room (`--max-waiting`);
with SLO-aware admission, that some plan can still meet the request's TTFT counting the prompt tokens
due before it. Then the request reserves its KV figure and waits in the table for a replica's loop.
"""

from __future__ import annotations

from collections.abc import Callable

from specserve.gateway.backends.pool import RECONNECT_INTERVAL_S, ServicePool
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.engine.table import RequestTable
from specserve.gateway.obs import spans
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.sched.admission.arrival import first_token_bound_ms
from specserve.shared.process import tracing


class ServiceUnavailable(Exception):
    """No target replica can be reached (or the request was refused): the HTTP answer is 503."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Intake:
    def __init__(self, table: RequestTable, pool: ServicePool, metrics: GatewayMetrics, config: GatewayConfig,
                 slo_admission: bool, wake: Callable[[int | None], None]):
        self.table, self.pool, self.metrics, self.config = table, pool, metrics, config
        self.slo_admission = slo_admission  # refuse on arrival what no plan can start within its TTFT
        self.wake = wake  # news for one replica's loop (None: for all)

    def submit(self, req: GenRequest) -> None:
        """Queue the request; ServiceUnavailable (503) when it is refused at once."""
        if not self.pool.any_target_up:
            raise ServiceUnavailable("no target replica is available", RECONNECT_INTERVAL_S)
        if len(self.table.waiting) >= self.config.max_waiting:
            self.metrics.on_error("queue_full")
            raise ServiceUnavailable(f"the server is busy: {len(self.table.waiting)} requests are waiting",
                                     self.retry_after_s())
        if self.slo_admission and not req.best_effort_ok:
            self._refuse_a_lost_first_token(req)
        req.kv_blocks = self.table.reserve_blocks_for(len(req.prompt), req.max_tokens)
        if tracing.ENABLED and req.trace is None:  # (a front end's request comes with its span)
            req.trace = spans.current()  # the request span (the handler's), for the iterations' links
        self.table.queue(req)
        self.metrics.on_queued()
        self.wake(None)

    def abort(self, rid: str, reason: str = "abort") -> None:
        """End a request early (client gone, or a stop string the handler found)."""
        req = self.table.requests.get(rid)
        if req is not None and req.finish_reason is None:
            replica = req.replica
            self.table.finish(req, reason)
            self.wake(replica)

    def pool_tokens_short(self, prompt_tokens: int, max_tokens: int) -> int | None:
        """The largest replica's whole KV pool, in tokens, when even it cannot hold this request's worst
        case (prompt + max_tokens + the tree slack); None when it can, or while no pool size is known."""
        blocks = self.pool.largest_pool_blocks
        if blocks and self.table.kv_blocks_for(prompt_tokens, max_tokens) > blocks:
            return blocks * self.pool.block_size
        return None

    def retry_after_s(self) -> float:
        """When the waiting queue should have room again: the queue ahead, served at the pace requests
        have been finishing (a moving average of their latency, spread over the admitted slots)."""
        slots = max(1, self.config.max_running * sum(t.up for t in self.pool.targets))
        return max(1.0, len(self.table.waiting) * self.table.mean_latency_s / slots)

    def tokens_due_before(self, req: GenRequest) -> int:
        """The prompt tokens SLO-aware admission gives chunks before `req`'s (they go in by TTFT deadline):
        those still to compute of every request waiting or prefilling with a deadline no later than its
        own, but those waiting that may run best effort and those prefilling in the best-effort tier (they
        get what the SLO prompts leave)."""
        deadline = req.arrival + req.slo.ttft_ms / 1e3

        def due(r: GenRequest) -> bool:
            return r.arrival + r.slo.ttft_ms / 1e3 <= deadline

        waiting = sum(len(r.context) - r.prefilled for r in self.table.waiting if not r.best_effort_ok and due(r))
        return waiting + sum(len(r.context) - max(r.prefilled, r.cached) for r in self.table.running.values()
                             if not r.decoding and not r.served_best_effort and due(r))

    def _refuse_a_lost_first_token(self, req: GenRequest) -> None:
        """SLO-aware admission: 503 on arrival when no plan can meet the request's TTFT, counting the
        prompt tokens due before it (`tokens_due_before`) and its own less what a replica's prefix cache
        is expected to hold."""
        due_before = self.tokens_due_before(req)
        costs = [t.cost for t in self.pool.targets if t.up and not t.retired]
        cached = max(self.table.prefix.per_replica(req), default=0)  # its prompt in a replica's prefix cache
        bound = first_token_bound_ms(len(req.prompt) - cached, due_before, costs, self.config.max_prefill_tokens)
        if bound > req.slo.ttft_ms:
            self.metrics.on_admission("refused", {req.slo.name: 1})
            raise ServiceUnavailable(f"no target replica can meet this request's TTFT SLO now ({req.slo.ttft_ms:g} ms; "
                                     f"at least {bound:.0f} ms with {due_before} prompt tokens due before it)",
                                     self.retry_after_s())


__all__ = ["Intake", "ServiceUnavailable"]
