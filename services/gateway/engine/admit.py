"""Admitter: the plan's admissions, rejections and preemptions applied to the table, and KV grown on
the way (`--kv-lookahead-tokens`).

An admitted request is bound to its replica (whose loop is woken) and told `Admitted`; a rejected one
ends with its reason and Retry-After. A preempted request gives its KV back on both services and waits
again at the head of the queue with its tokens (preempt.py chooses whom); so do the requests of a replica
that is lost while another is up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from specserve.gateway.backends.pool import ServicePool, TargetReplica
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.drafting import DraftCalls
from specserve.gateway.engine.preempt import Holder, victims
from specserve.gateway.engine.request import Admitted, GenRequest
from specserve.gateway.engine.table import RequestTable
from specserve.gateway.obs.metrics import ADMISSION_OUTCOMES, GatewayMetrics
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.admission.slo import SloAdmission
from specserve.gateway.sched.plan import IterationPlan

log = logging.getLogger("specserve.gateway")


class Admitter:
    def __init__(self, table: RequestTable, pool: ServicePool, drafts: DraftCalls, metrics: GatewayMetrics,
                 config: GatewayConfig, admission: SloAdmission | None, wake: Callable[[int | None], None]):
        self.table, self.pool, self.drafts, self.metrics, self.config = table, pool, drafts, metrics, config
        self.admission, self.wake = admission, wake

    def apply(self, plan: IterationPlan) -> IterationRecord:
        """The plan's preemptions, rejections and admissions; the iteration's record, begun. A request the
        plan names that has ended, or left the state it was planned in, since the plan was made (a pass
        committed in between, with --async-scheduling) is passed over."""
        now = time.perf_counter()
        if self.admission is not None:
            for outcome in ADMISSION_OUTCOMES:
                self.metrics.on_admission(outcome, getattr(self.admission.last, outcome))
        requests = self.table.requests
        for rid in plan.preempt:  # best effort giving its KV to SLO requests admitted below
            if (r := requests.get(rid)) is not None and r.replica is not None:
                self.preempt(r)
        for rid, reject in plan.rejected.items():
            if (r := requests.get(rid)) is not None and r.replica is None:
                self.metrics.on_error("rejected")
                self.table.finish(r, "rejected", reject.reason, retry_after_s=reject.retry_after_s)
        best_effort = self.admission.best_effort if self.admission is not None else set()
        for a in plan.admitted:
            r = requests.get(a.rid)
            if r is None or r.replica is not None:
                continue
            assert a.replica is not None
            self.table.bind(r, a.replica)
            self.table.prefix.admitted(r, self.pool.targets[a.replica])  # what its prefix cache holds of it
            r.admitted_at = now
            r.served_best_effort = r.served_best_effort or a.rid in best_effort
            self.wake(a.replica)  # its loop prefills it
            r.events.put_nowait(Admitted(a.replica))
            self.metrics.on_admitted(now - r.arrival)
        return IterationRecord(plan.step, admitted=len(plan.admitted), deferred=len(plan.deferred),
                               rejected=len(plan.rejected))

    def grow_reservations(self, replica_index: int) -> None:
        """Each decoding request's reservation on this replica covers its committed tokens and the next
        tree; one that outgrows it takes another look-ahead, preempting lower-priority requests when the
        replica is short (preempt.py)."""
        slack, block = self.config.tree_slack_tokens, self.pool.block_size
        for r in self.table.bound(replica_index):
            if r.finish_reason is not None or not r.decoding or r.replica is None:
                continue
            if math.ceil((r.committed + slack) / block) <= r.kv_blocks:
                continue
            replica = self.pool.targets[r.replica]
            want = self.table.reserve_blocks_for(r.committed, r.remaining) - r.kv_blocks
            free = replica.total_blocks - replica.reserved_blocks
            if want > free:
                best = self.admission.best_effort if self.admission is not None else set()
                holders = [Holder(x.rid, x.kv_blocks, x.rid in best, x.admitted_at or 0.0)
                           for x in self.table.bound(replica_index) if x.finish_reason is None]
                for rid in victims(holders, r.rid, want, free):
                    self.preempt(self.table.requests[rid])
                if r.replica is None:  # it was the one preempted
                    continue
            replica.reserved_blocks += want
            r.kv_blocks += want

    def preempt(self, r: GenRequest) -> None:
        """Give its KV back on both services and queue it again at the head; it keeps its tokens."""
        index = r.replica
        self._requeue(r)
        self.metrics.on_preempted()
        log.info("preempted %s (%d tokens kept) to free KV on target %d", r.rid, len(r.output), index)

    def replica_lost(self, replica: TargetReplica, why: str) -> None:
        """A replica that cannot be reached. While another replica takes new requests, every request it held
        waits again at the head of the queue, in admission order, with its tokens, and resumes there by
        recompute (prompt + output, as after a preemption: a stream goes on where it was); with none, they
        end with an error."""
        held = [self.table.requests[rid] for rid in replica.requests if rid in self.table.requests]
        if not held:
            return
        if not any(t.view().up for t in self.pool.targets if t is not replica):
            log.error("target %d (%s) failed (%s) and no other replica is up: ending its %d requests",
                      replica.index, replica.address, why, len(held))
            for r in held:
                self.table.finish(r, "error", f"the target service failed: {why}")
            return
        for r in reversed(held):
            self._requeue(r)
        self.metrics.on_moved(len(held))
        log.warning("target %d (%s) failed (%s): its %d requests wait to resume on another replica",
                    replica.index, replica.address, why, len(held))
        self.wake(None)

    def _requeue(self, r: GenRequest) -> None:
        """Off its replica (its KV owed back there, its draft state rebuilt) to the head of the waiting queue,
        keeping its tokens; never refused when it is planned again."""
        assert r.replica is not None
        self.table.unbind(r)
        if r.draft_seen:
            self.drafts.resync(r)
        r.replica, r.prefilled, r.out_of_blocks = None, 0, 0
        r.resuming, r.readmitted = bool(r.output), True
        r.kv_blocks = self.table.reserve_blocks_for(len(r.context), r.remaining)
        self.table.queue(r, first=True)

__all__ = ["Admitter"]
