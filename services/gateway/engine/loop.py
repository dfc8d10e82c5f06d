"""The Engine: one step loop per target replica, and a supervisor.

Each target replica has its own asyncio task that runs its iterations back to back while it has
work; a replica never waits for another replica's pass. One step of replica k reads:

    plan = scheduler.plan(snapshot)            # admissions, chunks, tree shapes, draft residency
    record = admitter.apply(plan)              # bind, reject, preempt
    trees = draft trees of k's decoders        # drafting.py (overlap.py with --overlap)
    trees = passes.constrain(trees)            # structured output: forced tokens, pruning, masks
    pass = passes.build(plan, trees)           # the policy selects the nodes to verify
    passes.run(pass)                           # target pass (+ a draft call beside it), commit
    consume(record)                            # metrics, cost model, policy, admission learn

With --async-scheduling a pass that depends on nothing the pass in flight returns is sent before that
one is committed, and committed in the next iteration (engine/ahead.py). Before each step the draft
is sent the releases it is owed; the replica's go with its pass (in a call of their
own when no pass runs). A supervisor task reconnects services that are down, pings them while nothing
runs, and starts a loop for every replica that discovery adds.

Failures stay where they belong: an error on one entry ends that request; a service that answers a
whole call with an error stays up and only that call's requests are ended (target) or fall back to
plain decoding (draft); a service that cannot be reached is marked down, its requests move to another
target replica and resume there by recompute (or end with an error when none is up) or speculation
pauses (draft), and it is reconnected when it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from specserve.gateway.backends.executor import Executor
from specserve.gateway.backends.pool import RECONNECT_INTERVAL_S, ServicePool, TargetReplica
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.admit import Admitter
from specserve.gateway.engine.ahead import InFlight, ahead_on, runs_ahead, under_guesses
from specserve.gateway.engine.drafting import DraftCalls
from specserve.gateway.engine.intake import Intake
from specserve.gateway.engine.overlap import guesses, held_trees
from specserve.gateway.engine.passes import Passes
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.engine.snapshot import Snapshots
from specserve.gateway.engine.table import RequestTable
from specserve.gateway.obs import spans
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import IterationPlan, Residency
from specserve.gateway.sched.policy import CandidateTree, Policy
from specserve.gateway.sched.scheduler import Scheduler
from specserve.shared.process import tracing
from specserve.shared.wire.rpc import TRANSPORT_ERRORS

log = logging.getLogger("specserve.gateway")
REPLAN_INTERVAL_S = 0.05  # requests wait that no replica takes and nothing runs: plan again after this


class Engine:
    def __init__(self, policy: Policy, scheduler: Scheduler, pool: ServicePool, metrics: GatewayMetrics,
                 config: GatewayConfig):
        self.policy, self.scheduler, self.pool, self.metrics = policy, scheduler, pool, metrics
        self.overlap = config.overlap  # draft the next trees beside the target pass (overlap.py)
        self.draft_misses = config.overlap_miss == "draft"  # a wrong guess drafts before the pass (else: root alone)
        self.executor = Executor(pool, config.call_timeout_s, config.draft_window_ms, self._replicas_with_requests)
        self.table = RequestTable(pool, metrics, config)
        self.intake = Intake(self.table, pool, metrics, config, scheduler.admission is not None, self._wake)
        self.drafts = DraftCalls(self.table, pool, self.executor)
        self.admitter = Admitter(self.table, pool, self.drafts, metrics, config, scheduler.admission, self._wake)
        self.passes = Passes(self.table, pool, self.executor, policy, self.drafts, metrics,
                             self.admitter.replica_lost, config.forced_tokens)
        self.snapshots = Snapshots(self.table, pool, config)
        self.grow_kv = config.kv_lookahead_tokens > 0  # reservations grow on the way (--kv-lookahead-tokens)
        # --async-scheduling: where it applies, each replica's pass sent before the last one is committed
        self.ahead_mode = config.async_scheduling if (not config.overlap and config.draft_sync == "lazy"
                                                      and not self.grow_kv) else "off"
        self._ahead: dict[int, InFlight] = {}  # per replica: its pass in flight, not committed yet
        self._settled = 0  # passes sent ahead and committed since start
        self._wakes: dict[int, asyncio.Event] = {}  # per replica: news for its loop
        self._loops: dict[int, asyncio.Task[None]] = {}  # per replica: its step loop
        self._supervisor: asyncio.Task[None] | None = None
        self.step = 0  # iterations started, all replicas (each iteration's step number)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.pool.connect_all()
        self.metrics.set_budget(self.pool.targets[0].cost.budget_tokens)
        self._start_loops()
        self._supervisor = asyncio.create_task(self._supervise(), name="engine-supervisor")

    async def close(self) -> None:
        tasks = [t for t in (*self._loops.values(), self._supervisor, *(f.task for f in self._ahead.values()))
                 if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for r in list(self.table.requests.values()):
            self.table.finish(r, "abort")
        with contextlib.suppress(*TRANSPORT_ERRORS):
            await self.executor.release_owed()
        await self.pool.close()

    def _start_loops(self) -> None:
        """A step loop for every replica that has none (at start, and for each one discovery adds)."""
        for replica in self.pool.targets:
            if replica.index not in self._loops:
                self._wakes[replica.index] = asyncio.Event()
                self._loops[replica.index] = asyncio.create_task(self._replica_loop(replica),
                                                                 name=f"replica-{replica.index}")

    def _wake(self, replica: int | None = None) -> None:
        """News for one replica's loop (None: for every loop, e.g. an arrival any of them may admit)."""
        for i, event in self._wakes.items():
            if replica is None or i == replica:
                event.set()

    async def _supervise(self) -> None:
        """Every interval: reconnect services that are down, start loops for new replicas, ping the
        services while nothing runs (one that died while idle is marked down now), send the draft the
        releases it is owed while nothing speculates, and end waiting requests when no target is up."""
        while True:
            await asyncio.sleep(RECONNECT_INTERVAL_S)
            try:
                if self.pool.needs_reconnect:
                    back = await self.pool.reconnect(TRANSPORT_ERRORS)
                    if "draft" in back:
                        self.drafts.lost()  # it may have restarted empty: every request rebuilds its draft state
                    if back:
                        self._wake()
                self._start_loops()
                if not self.table.running and not self.table.waiting:
                    await self.executor.ping()
                    await self.executor.release_owed()
                elif not self.pool.any_target_up:
                    for r in list(self.table.waiting):
                        self.table.finish(r, "error", "no target replica is available")
                self._set_load()
            except Exception:  # a bug here must not stop reconnecting
                log.exception("the engine's supervisor failed; it goes on")

    # ---- the loops ------------------------------------------------------------------------------
    async def _replica_loop(self, replica: TargetReplica) -> None:
        """Replica k's iterations, back to back while it has work; asleep until news otherwise."""
        wake = self._wakes[replica.index]
        while True:
            if not self._has_work(replica):
                self.snapshots.last.pop(replica.index, None)
                wake.clear()
                await wake.wait()
                continue
            try:
                busy = await self._iteration(replica)
            except Exception:  # a bug in one iteration must not stop serving
                log.exception("an iteration of target %d failed; its requests are ended", replica.index)
                for r in self.table.bound(replica.index):
                    self.table.finish(r, "error", "internal error in the gateway")
                busy = True
            if busy:
                await asyncio.sleep(0)
                continue
            # requests wait that no replica takes yet and nothing ran: an iteration that awaits nothing
            # would hold the event loop (no HTTP handler, no arrival); plan again on news or after a tick
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), REPLAN_INTERVAL_S)

    def _replicas_with_requests(self) -> int:
        """The replicas a draft call may wait for (the draft window): up, with requests bound."""
        return sum(1 for t in self.pool.targets if t.up and t.requests)

    def _has_work(self, replica: TargetReplica) -> bool:
        if replica.requests or (replica.up and replica.owed_releases) or replica.index in self._ahead:
            return True
        return bool(self.table.waiting) and replica.up and not replica.retired

    async def _iteration(self, replica: TargetReplica) -> bool:
        """One iteration of a replica; False when it changed nothing (no pass ran or was committed, nobody was
        admitted or refused)."""
        t0 = time.perf_counter()
        settled = self._settled
        if self.grow_kv:
            self.admitter.grow_reservations(replica.index)  # a preempted request's releases go out this iteration
        await self.executor.release_owed(replica, target=False)  # the draft's; the replica's go with its pass
        if replica.up and not replica.ready:  # its connection closed (killed): down now, not at a failed call
            await replica.mark_down()
        if replica.index in self._ahead and (not replica.up or not (replica.requests or self.table.waiting)):
            await self._settle(self._ahead.pop(replica.index), replica, t0)  # nothing to send ahead of it
        if not replica.up:
            if replica.requests:
                self.admitter.replica_lost(replica, "the connection was lost")
            return False
        if not replica.requests and not self.table.waiting:
            await self.executor.release_owed(replica)
            return True  # only releases were owed
        self.step += 1
        if tracing.ENABLED:
            traces = {r.rid: r.trace for r in (*self.table.bound(replica.index), *self.table.waiting)
                      if r.trace is not None}
            with spans.iteration(self.step, t0) as span:
                record = await self._step(replica, self.step, t0)
                spans.record_iteration(span, record, traces)
        else:
            record = await self._step(replica, self.step, t0)
        return (bool(record.replicas or record.admitted or record.rejected) or replica.index in self._ahead
                or self._settled != settled)

    async def _step(self, replica: TargetReplica, step: int, t0: float) -> IterationRecord:
        prev = self._ahead.pop(replica.index, None)  # its pass in flight (--async-scheduling)
        plan = self.scheduler.plan(self.snapshots.take(replica.index, t0), step)
        sent_ahead = self._runs_ahead(plan, replica)
        if prev is not None and not sent_ahead:  # this pass depends on that one's answer: commit it first, and
            await self._settle(prev, replica, t0)  # carry out this plan (the policies' state saw it once)
            prev = None
        record = self.admitter.apply(plan)
        mine = self.table.bound(replica.index)
        decoding = [r for r in mine if r.decoding and r.rid in plan.shapes]
        placeholders: dict[str, int] = {}
        if sent_ahead:  # chains drafted while the pass in flight runs, on a guess of its answer where it has one
            items, roots = self.drafts.ahead_items(plan, decoding)
            trees = await self.drafts.speculate(plan, decoding, record, items, roots)
            placeholders = under_guesses(trees, roots)
            if items:  # the pass in flight may have been committed meanwhile: what it ended or moved is passed over
                mine = [r for r in mine if r.replica == replica.index and r.finish_reason is None]
                decoding = [r for r in decoding if r.replica == replica.index and r.finish_reason is None]
        else:
            trees = self.passes.constrain(replica.index, decoding, await self._trees(plan, decoding, record))
        with tracing.span("policy.select"):
            target_pass, selected = self.passes.build(plan, replica.index, mine, decoding, trees, record, sent_ahead,
                                                      placeholders)
        if target_pass is not None and sent_ahead:
            record.sent_ahead = True
            task = asyncio.ensure_future(self.passes.run(plan, [target_pass], record, {}))
            self._ahead[replica.index] = InFlight(task, record, t0)
            await asyncio.sleep(0)  # its frame goes out now, before the pass in flight is committed
            if prev is not None:
                await self._settle(prev, replica, t0)
            return record
        if prev is not None:
            await self._settle(prev, replica, t0)
        if target_pass is not None:
            ahead = guesses(plan, decoding, trees, selected, self.drafts.max_depth) if self.overlap else {}
            await self.passes.run(plan, [target_pass], record, ahead)
        elif replica.owed_releases:  # no pass to carry them
            await self.executor.release_owed(replica)
        self._consume(record, replica, t0)
        return record

    def _runs_ahead(self, plan: IterationPlan, replica: TargetReplica) -> bool:
        """This plan's pass may go before the replica's pass in flight is committed (engine/ahead.py)."""
        return (ahead_on(self.ahead_mode, replica.device) and not tracing.ENABLED
                and runs_ahead(plan, self.table.bound(replica.index)))

    async def _settle(self, prev: InFlight, replica: TargetReplica, end: float) -> None:
        """A pass sent ahead: its reply committed (its call's task does that), then its record consumed, its
        iteration's time ending at `end` (when the iteration that settles it began: the iterations' times add
        up to the wall time, not counting the overlap twice)."""
        await prev.task
        self._settled += 1
        self._consume(prev.record, replica, prev.t0, end)

    async def _trees(self, plan: IterationPlan, decoding: list[GenRequest],
                     record: IterationRecord) -> dict[str, CandidateTree]:
        """The draft's residency as planned, then the trees to verify: drafted now, or with --overlap
        the ones drafted ahead during the last pass (a miss drafts now only with --overlap-miss draft)."""
        if plan.residency is not Residency.KEEP:
            await self.drafts.transition(plan, record)
        if not self.overlap:
            return await self.drafts.speculate(plan, decoding, record)
        trees = held_trees(plan, decoding)
        if self.draft_misses:
            trees.update(await self.drafts.speculate(plan, [r for r in decoding if r.rid not in trees], record))
        return trees

    # ---- the record's consumers ---------------------------------------------------------------
    def _consume(self, record: IterationRecord, replica: TargetReplica, t0: float, end: float | None = None) -> None:
        record.total_ms = ((time.perf_counter() if end is None else end) - t0) * 1e3
        record.waiting, record.running = len(self.table.waiting), len(self.table.running)
        if not record.replicas:
            self._set_load()
            return
        self.metrics.on_iteration(record)
        replica.cost.observe_record(record, replica.index, replica.held_blocks)  # its own passes only
        self.policy.observe(record)
        if self.scheduler.admission is not None:
            self.scheduler.admission.observe(record)
        self._set_load(replica)

    def _set_load(self, only: TargetReplica | None = None) -> None:
        """The load gauges: running, waiting and the KV in use over all replicas, and each replica's own
        series (`only`: just that replica's; the supervisor refreshes them all every second)."""
        used = total = 0
        for t in self.pool.targets:
            t_used = t.held_blocks
            if t.up and t.total_blocks:
                used, total = used + t_used, total + t.total_blocks
            if only is not None and t is not only:
                continue
            if t.retired and not t.up:  # dropped (discovery.py): no series of its own any more
                self.metrics.drop_replica(str(t.index))
            elif t.up and t.total_blocks:
                self.metrics.set_replica(str(t.index), True, len(t.requests), t_used / t.total_blocks)
            else:
                self.metrics.set_replica(str(t.index), False, len(t.requests), 0.0)
        self.metrics.set_load(len(self.table.running), len(self.table.waiting), used / total if total else 0.0)


__all__ = ["Engine"]
