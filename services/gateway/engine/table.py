"""RequestTable: every request the engine holds, the waiting queue, and which replica holds each one.

A request is in `requests` from its submission to its end: waiting (in `waiting`, no replica) or bound
(in `running` and in its replica's `TargetReplica.requests`, `GenRequest.replica` set). `bind` and
`unbind` are the only places a request joins or leaves a replica, and `unbind` is the one routine that
gives its target KV back; `finish` is the only way out of the table. No I/O: releases owed to a
service are queued on it for the executor to send.
"""

from __future__ import annotations

import contextlib
import math
import time

from specserve.gateway.backends.pool import ServicePool
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine import ahead
from specserve.gateway.engine.prefix import PrefixCaches
from specserve.gateway.engine.request import Finished, GenRequest, Tokens
from specserve.gateway.obs.metrics import GatewayMetrics


class RequestTable:
    def __init__(self, pool: ServicePool, metrics: GatewayMetrics, config: GatewayConfig):
        self.pool, self.metrics, self.config = pool, metrics, config
        self.requests: dict[str, GenRequest] = {}  # every request not yet finished
        self.waiting: list[GenRequest] = []  # not bound to a replica, in the order admission sees them
        self.running: dict[str, GenRequest] = {}  # bound to a replica, in admission order
        self.prefix = PrefixCaches(pool, metrics)  # the replicas' prefix caches as the gateway sees them
        self.mean_latency_s = 1.0  # moving average of finished requests' latency (Retry-After)

    # ---- KV ---------------------------------------------------------------------------------------
    def kv_blocks_for(self, prompt_tokens: int, max_tokens: int) -> int:
        """The worst case: prompt + max_tokens + the tree slack."""
        return math.ceil((prompt_tokens + max_tokens + self.config.tree_slack_tokens) / self.pool.block_size)

    def reserve_blocks_for(self, context_tokens: int, remaining: int) -> int:
        """What admission reserves: the worst case, or with a look-ahead only that much of the output."""
        lookahead = self.config.kv_lookahead_tokens
        return self.kv_blocks_for(context_tokens, min(remaining, lookahead) if lookahead > 0 else remaining)

    # ---- membership -------------------------------------------------------------------------------
    def queue(self, r: GenRequest, first: bool = False) -> None:
        """Into the waiting queue: at its end, or at its head (`first`, a preempted request)."""
        self.requests[r.rid] = r
        if first:
            self.waiting.insert(0, r)
        else:
            self.waiting.append(r)

    def bound(self, replica: int) -> list[GenRequest]:
        """The requests bound to a replica, in admission order."""
        return list(self.pool.targets[replica].requests.values())

    def holds(self, rid: str, replica: int) -> bool:
        """Whether the request is still bound to that replica."""
        r = self.requests.get(rid)
        return r is not None and r.replica == replica

    def bind(self, r: GenRequest, replica: int) -> None:
        """Out of the waiting queue onto a replica, its KV reserved there."""
        self.waiting.remove(r)
        target = self.pool.targets[replica]
        r.replica = replica
        self.running[r.rid] = r
        target.requests[r.rid] = r
        target.reserved_blocks += r.kv_blocks

    def unbind(self, r: GenRequest) -> None:
        """The one place a bound request leaves its replica: out of the running set, its target KV given
        back (its reservation, and a release owed to the target). `r.replica` and its draft state are the
        caller's."""
        self.running.pop(r.rid, None)
        if r.replica is not None:
            target = self.pool.targets[r.replica]
            target.requests.pop(r.rid, None)
            target.reserved_blocks -= r.kv_blocks
            target.owed_releases.add(r.rid)
            self.prefix.released(r, target)  # its blocks stay in the replica's prefix cache
            ahead.unbound(r)  # what it has in flight there no longer applies

    def finish(self, r: GenRequest, reason: str, error: str | None = None,
               retry_after_s: float | None = None) -> None:
        """End a request: out of the table (its KV and draft state owed back), its handler told (with its
        report; also when the handler asked for the end), its outcome counted. Ending one that has ended
        does nothing."""
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        if r.replica is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(r)
        else:
            self.unbind(r)  # (r.replica stays: its report names the replica that served it)
            if self.pool.draft is not None and r.draft_seen:
                self.pool.draft.owed_releases.add(r.rid)
        self.requests.pop(r.rid, None)
        if r.held:  # a final-only request's output, handed over with its end
            r.events.put_nowait(Tokens(r.held, None, None))
            r.held = []
        r.events.put_nowait(Finished(reason, error, retry_after_s, r.report()))
        served = reason in ("stop", "length")
        e2e = time.perf_counter() - r.arrival
        if served:
            self.mean_latency_s += 0.1 * (e2e - self.mean_latency_s)
        self.metrics.on_finished(reason, len(r.prompt), len(r.output), e2e, r.tpot_s(), r.slo.name,
                                 r.slo_met() if served else None, r.ttft_s())


__all__ = ["RequestTable"]
