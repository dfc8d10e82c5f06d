"""Snapshots: what the scheduler sees of the engine at one replica's iteration (`SchedulerView`).

The waiting queue and the replica's own requests as they are now; while requests wait, the other
replicas' requests too, as their loops' last snapshots saw them (less those that have ended or moved
since), so that admission weighs every replica's load without one loop reading another's live state.
"""

from __future__ import annotations

from specserve.gateway.backends.pool import ServicePool
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.prefix import PRICED_WAITING
from specserve.gateway.engine.table import RequestTable
from specserve.gateway.sched.plan import DraftView, Limits, PrefillView, SchedulerView, WaitingView
from specserve.gateway.sched.policy import RequestView


class Snapshots:
    def __init__(self, table: RequestTable, pool: ServicePool, config: GatewayConfig):
        self.table, self.pool, self.config = table, pool, config
        self.last: dict[int, tuple[list[RequestView], list[PrefillView]]] = {}  # per replica: its last own

    def limits(self) -> Limits:
        """The scheduler's limits: the gateway's, and the tree caps the draft reported."""
        draft = self.pool.draft
        return Limits(self.config.max_running, self.config.max_prefill_tokens,
                      draft.max_depth if draft is not None else 0, draft.max_width if draft is not None else 0)

    def take(self, replica: int, now: float) -> SchedulerView:
        prefix = self.table.prefix
        usable = prefix.usable() if self.table.waiting else []
        waiting = [WaitingView(r.rid, len(r.context), r.remaining, r.kv_blocks, r.slo.name, r.slo.tpot_ms,
                               r.slo.ttft_ms, (now - r.arrival) * 1e3, r.best_effort_ok or r.readmitted,
                               prefix.per_replica(r, usable) if i < PRICED_WAITING else ())
                   for i, r in enumerate(self.table.waiting)]  # one admitted before is never refused
        prefilling: list[PrefillView] = []
        decoding: list[RequestView] = []
        for r in self.table.bound(replica):
            if r.decoding:
                decoding.append(RequestView(r.rid, r.slo.name, r.slo.tpot_ms, r.slo.ttft_ms, len(r.output) - 1,
                                            (now - r.token_times[0]) * 1e3, r.remaining, r.accepted, replica,
                                            len(r.draft_unsent), r.kv_blocks))
            elif r.prefilled < len(r.context):  # (what its replica's prefix cache holds counts as prefilled)
                prefilling.append(PrefillView(r.rid, replica, len(r.context), max(r.prefilled, r.cached), r.slo.name,
                                              r.slo.tpot_ms, r.slo.ttft_ms, (now - r.arrival) * 1e3))
        self.last[replica] = (decoding, prefilling)
        if self.table.waiting and len(self.last) > 1:  # admission weighs every replica's load
            decoding, prefilling = list(decoding), list(prefilling)
            for other, (dec, pre) in self.last.items():
                if other != replica:
                    decoding += [v for v in dec if self.table.holds(v.rid, other)]
                    prefilling += [v for v in pre if self.table.holds(v.rid, other)]
        draft = self.pool.draft.view() if self.pool.draft is not None else DraftView(False, False)
        return SchedulerView(waiting, prefilling, decoding, [t.view() for t in self.pool.targets], draft,
                             self.limits(), replica=replica, live=self.table.running.keys())


__all__ = ["Snapshots"]
