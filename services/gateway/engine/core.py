"""The gateway's step loops: per target replica, snapshot, plan, speculate, select, verify, commit, record.

Each target replica has its own asyncio task that runs its iterations back to back while it has
work; a replica never waits for another replica's pass. One iteration of replica k:

1. sends replica k (and the draft) the releases they are owed;
2. takes a snapshot (the waiting queue, k's requests fresh, the other replicas' requests as their
   own last snapshots saw them) and asks the scheduler for one `IterationPlan` (admissions to any
   replica, deferrals, rejections, k's prompt chunks and speculation shapes, the draft's residency);
3. applies the admissions: each request is bound to its replica (whose loop is woken) and reserves
   its KV blocks there;
4. changes the draft's residency if the plan says so, then hands the draft k's requests with d > 0
   (the executor sends the entries of every replica that is ready in one call);
5. asks the policy which candidate nodes of k's trees to verify;
6. sends replica k its prompt chunks and trees (with the eager draft sync beside them, if on);
7. hands every request its emitted tokens (cut at EOS / max_tokens), and builds the one
   `IterationRecord` that metrics, replica k's latency model and the policy consume.

A supervisor task reconnects services that are down, pings them while nothing runs, and starts a
loop for every replica that discovery adds.

Failures stay where they belong: an error on one entry ends that request; a service that answers a
whole call with an error stays up and only that call's requests are ended (target) or fall back to
plain decoding (draft); a service that cannot be reached is marked down, its requests end with an
error (target) or speculation pauses (draft), and it is reconnected when it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

from specserve.gateway.backends.executor import Executor, Failure, TargetPass
from specserve.gateway.backends.pool import RECONNECT_INTERVAL_S, ServicePool, TargetReplica
from specserve.gateway.engine.ahead import Guess, assumed_path, next_tree, reroot
from specserve.gateway.engine.preempt import Holder, victims
from specserve.gateway.engine.record import IterationRecord, ReplicaStep, RequestStep
from specserve.gateway.engine.request import Admitted, Finished, GenRequest, Tokens
from specserve.gateway.obs import spans
from specserve.gateway.obs.metrics import ADMISSION_OUTCOMES, GatewayMetrics
from specserve.gateway.sched.admission.slo import first_token_bound_ms
from specserve.gateway.sched.plan import (
    DraftView,
    IterationPlan,
    Limits,
    PrefillView,
    Residency,
    SchedulerView,
    WaitingView,
)
from specserve.gateway.sched.policy import CandidateTree, Policy, RequestView
from specserve.gateway.sched.scheduler import Scheduler
from specserve.shared import tracing
from specserve.shared.feature_log import FeatureLog
from specserve.shared.rpc import TRANSPORT_ERRORS
from specserve.shared.service_client import Candidate, PrefillItem, SpeculateItem, StepOutput, VerifyItem

log = logging.getLogger("specserve.gateway")
REPLAN_INTERVAL_S = 0.05  # requests wait that no replica takes and nothing runs: plan again after this


class ServiceUnavailable(Exception):
    """No target replica can be reached (or the request was refused): the HTTP answer is 503."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class EngineLimits:
    max_running: int = 64  # most requests bound to one replica
    max_prefill_tokens: int = 256  # most prompt tokens in one replica's pass
    tree_slack_tokens: int = 64  # KV reserved per request beyond prompt + max_tokens (tree slots)
    draft_max_depth: int = 16  # the draft service's caps (its --max-depth / --max-width defaults)
    draft_max_width: int = 16
    max_waiting: int = 256  # most requests waiting for admission; more get 503
    max_out_of_blocks: int = 200  # iterations a request may be refused for KV room before it is ended
    kv_lookahead_tokens: int = 0  # > 0: reserve context + this many tokens, grow on the way, preempt when short


class Engine:
    def __init__(self, policy: Policy, scheduler: Scheduler, pool: ServicePool, metrics: GatewayMetrics,
                 limits: EngineLimits, call_timeout_s: float = 30.0, overlap: bool = False,
                 draft_misses: bool = False, draft_window_ms: float = 0.0):
        self.policy, self.scheduler, self.pool, self.metrics = policy, scheduler, pool, metrics
        self.limits = limits
        self.overlap = overlap  # draft the next trees beside the target pass (ahead.py)
        self.draft_misses = draft_misses  # with overlap: a wrong guess drafts before the pass (else: root alone)
        self.executor = Executor(pool, call_timeout_s, draft_window_ms, self._replicas_with_requests)
        self.waiting: list[GenRequest] = []
        self.running: dict[str, GenRequest] = {}  # admitted, in admission order
        self._on: dict[int, dict[str, GenRequest]] = {}  # per replica: its admitted requests, in admission order
        self.requests: dict[str, GenRequest] = {}
        self._wakes: dict[int, asyncio.Event] = {}  # per replica: news for its loop
        self._loops: dict[int, asyncio.Task[None]] = {}  # per replica: its step loop
        self._views: dict[int, tuple[list[RequestView], list[PrefillView]]] = {}  # its last snapshot's own
        self._supervisor: asyncio.Task[None] | None = None
        self.step = 0  # iterations started, all replicas (each iteration's step number)
        self._mean_latency_s = 1.0  # moving average of finished requests' latency (Retry-After)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.pool.connect_all()
        self.metrics.set_budget(self.pool.targets[0].cost.budget_tokens)
        self._start_loops()
        self._supervisor = asyncio.create_task(self._supervise(), name="engine-supervisor")

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

    async def close(self) -> None:
        tasks = [t for t in (*self._loops.values(), self._supervisor) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for r in list(self.requests.values()):
            self._finish(r, "abort")
        with contextlib.suppress(*TRANSPORT_ERRORS):
            await self.executor.release_owed()
        await self.pool.close()

    def pool_tokens_short(self, prompt_tokens: int, max_tokens: int) -> int | None:
        """The largest replica's whole KV pool, in tokens, when even it cannot hold this request's worst
        case (prompt + max_tokens + the tree slack); None when it can, or while no pool size is known."""
        blocks = self.pool.largest_pool_blocks
        if blocks and self.kv_blocks_for(prompt_tokens, max_tokens) > blocks:
            return blocks * self.pool.block_size
        return None

    # ---- requests --------------------------------------------------------------------------------
    def kv_blocks_for(self, prompt_tokens: int, max_tokens: int) -> int:
        """The worst case: prompt + max_tokens + the tree slack."""
        return math.ceil((prompt_tokens + max_tokens + self.limits.tree_slack_tokens) / self.pool.block_size)

    def reserve_blocks_for(self, context_tokens: int, remaining: int) -> int:
        """What admission reserves: the worst case, or with a look-ahead only that much of the output."""
        ahead = self.limits.kv_lookahead_tokens
        return self.kv_blocks_for(context_tokens, min(remaining, ahead) if ahead > 0 else remaining)

    def submit(self, req: GenRequest) -> None:
        if not self.pool.any_target_up:
            raise ServiceUnavailable("no target replica is available", RECONNECT_INTERVAL_S)
        if len(self.waiting) >= self.limits.max_waiting:
            self.metrics.on_error("queue_full")
            raise ServiceUnavailable(f"the server is busy: {len(self.waiting)} requests are waiting",
                                     self.retry_after_s())
        if self.scheduler.admission is not None and not req.best_effort_ok:
            self._refuse_a_lost_first_token(req)
        req.kv_blocks = self.reserve_blocks_for(len(req.prompt), req.max_tokens)
        if tracing.ENABLED and req.trace is None:  # (a front end's request comes with its span)
            req.trace = spans.current()  # the request span (the handler's), for the iterations' links
        self.requests[req.rid] = req
        self.waiting.append(req)
        self.metrics.on_queued()
        self._wake()

    def _refuse_a_lost_first_token(self, req: GenRequest) -> None:
        """SLO-aware admission: 503 on arrival when no plan can meet the request's TTFT, counting the
        prompt tokens due before it (those waiting with a TTFT deadline no later, those prefilling)."""
        deadline = req.arrival + req.slo.ttft_ms / 1e3
        ahead = sum(len(r.context) - r.prefilled for r in self.waiting
                    if not r.best_effort_ok and r.arrival + r.slo.ttft_ms / 1e3 <= deadline)
        ahead += sum(len(r.context) - r.prefilled for r in self.running.values() if not r.decoding)
        costs = [t.cost for t in self.pool.targets if t.up and not t.retired]
        bound = first_token_bound_ms(len(req.prompt), ahead, costs, self.limits.max_prefill_tokens)
        if bound > req.slo.ttft_ms:
            self.metrics.on_admission("refused", {req.slo.name: 1})
            raise ServiceUnavailable(f"no target replica can meet this request's TTFT SLO now ({req.slo.ttft_ms:g} ms; "
                                     f"at least {bound:.0f} ms with {ahead} prompt tokens due before it)",
                                     self.retry_after_s())

    def retry_after_s(self) -> float:
        """When the waiting queue should have room again: the queue ahead, served at the pace requests
        have been finishing (a moving average of their latency, spread over the admitted slots)."""
        slots = max(1, self.limits.max_running * sum(t.up for t in self.pool.targets))
        return max(1.0, len(self.waiting) * self._mean_latency_s / slots)

    def abort(self, rid: str, reason: str = "abort") -> None:
        """End a request early (client gone, or a stop string the handler found)."""
        req = self.requests.get(rid)
        if req is not None and req.finish_reason is None:
            replica = req.replica
            self._finish(req, reason, notify=False)
            self._wake(replica)

    def _finish(self, r: GenRequest, reason: str, error: str | None = None, notify: bool = True,
                retry_after_s: float | None = None) -> None:
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        if r.replica is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(r)
        else:
            self._unbind(r)
            if self.pool.draft is not None and r.draft_seen:
                self.pool.draft.owed_releases.add(r.rid)
        self.requests.pop(r.rid, None)
        if notify:
            r.events.put_nowait(Finished(reason, error, retry_after_s))
        tpot = r.tpot_s()
        ok = r.slo_met() if reason in ("stop", "length") else None
        e2e = time.perf_counter() - r.arrival
        if reason in ("stop", "length"):
            self._mean_latency_s += 0.1 * (e2e - self._mean_latency_s)
        self.metrics.on_finished(reason, len(r.prompt), len(r.output), e2e, tpot, r.slo.name, ok,
                                 r.ttft_s())

    # ---- the loops ------------------------------------------------------------------------------
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
                        self._draft_lost()  # it may have restarted empty: every request rebuilds its draft state
                    if back:
                        self._wake()
                self._start_loops()
                if not self.running and not self.waiting:
                    await self.executor.ping()
                    await self.executor.release_owed()
                elif not self.pool.any_target_up:
                    for r in list(self.waiting):
                        self._finish(r, "error", "no target replica is available")
                self._set_load()
            except Exception:  # a bug here must not stop reconnecting
                log.exception("the engine's supervisor failed; it goes on")

    async def _replica_loop(self, replica: TargetReplica) -> None:
        """Replica k's iterations, back to back while it has work; asleep until news otherwise."""
        wake = self._wakes[replica.index]
        while True:
            if not self._has_work(replica):
                self._views.pop(replica.index, None)
                wake.clear()
                await wake.wait()
                continue
            try:
                busy = await self._iteration(replica)
            except Exception:  # a bug in one iteration must not stop serving
                log.exception("an iteration of target %d failed; its requests are ended", replica.index)
                for r in self._bound(replica.index):
                    self._finish(r, "error", "internal error in the gateway")
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
        if replica.requests or (replica.up and replica.owed_releases):
            return True
        return bool(self.waiting) and replica.up and not replica.retired

    def _bound(self, replica: int) -> list[GenRequest]:
        """The requests bound to a replica, in admission order."""
        return list(self._on.get(replica, {}).values())

    def _bind(self, r: GenRequest, replica: int) -> None:
        r.replica = replica
        self.running[r.rid] = r
        self._on.setdefault(replica, {})[r.rid] = r

    def _unbind(self, r: GenRequest) -> None:
        """The one place a bound request leaves its replica: out of the running set, its target KV given
        back (its reservation, and a release owed to the target). Its draft state is the caller's."""
        self.running.pop(r.rid, None)
        if r.replica is not None:
            self._on.get(r.replica, {}).pop(r.rid, None)
            replica = self.pool.targets[r.replica]
            replica.requests.discard(r.rid)
            replica.reserved_blocks -= r.kv_blocks
            replica.owed_releases.add(r.rid)

    async def _iteration(self, replica: TargetReplica) -> bool:
        """One iteration of a replica; False when it changed nothing (no pass ran, nobody was admitted or
        refused)."""
        t0 = time.perf_counter()
        if self.limits.kv_lookahead_tokens > 0:
            self._grow_reservations(replica.index)  # before the releases, so a preempted request's go out now
        await self.executor.release_owed(replica)
        if not replica.up:
            if replica.requests:
                self._end_replica_requests(replica, "the connection was lost")
            return False
        if not replica.requests and not self.waiting:
            return True  # only releases were owed
        self.step += 1
        if tracing.ENABLED:
            traces = {r.rid: r.trace for r in (*self._bound(replica.index), *self.waiting) if r.trace is not None}
            with spans.iteration(self.step, t0) as span:
                record = await self._step(replica, self.step, t0)
                spans.record_iteration(span, record, traces)
        else:
            record = await self._step(replica, self.step, t0)
        return bool(record.replicas or record.admitted or record.rejected)

    async def _step(self, replica: TargetReplica, step: int, t0: float) -> IterationRecord:
        plan = self.scheduler.plan(self._snapshot(replica.index, t0), step)
        self._apply_admission(plan)
        record = IterationRecord(step, admitted=len(plan.admitted), deferred=len(plan.deferred),
                                 rejected=len(plan.rejected))
        if plan.residency is not Residency.KEEP:
            await self._transition(plan, record)
        mine = self._bound(replica.index)
        decoding = [r for r in mine if r.decoding and r.rid in plan.shapes]
        if not self.overlap:
            trees = await self._speculate(plan, decoding, record)
        else:
            trees = self._held_trees(plan, decoding)
            if self.draft_misses:
                trees.update(await self._speculate(plan, [r for r in decoding if r.rid not in trees], record))
        with tracing.span("policy.select"):
            passes, selected = self._passes(plan, replica.index, mine, decoding, trees, record)
        if passes:
            ahead = self._ahead_items(plan, decoding, trees, selected) if self.overlap else {}
            await self._target_pass(plan, passes, record, ahead)
        record.total_ms = (time.perf_counter() - t0) * 1e3
        record.waiting, record.running = len(self.waiting), len(self.running)
        self._consume(record, replica)
        return record

    # ---- 1b. KV reservations with a look-ahead ------------------------------------------------------
    def _grow_reservations(self, replica_index: int) -> None:
        """Each decoding request's reservation on this replica covers its committed tokens and the next
        tree; one that outgrows it takes another look-ahead, preempting lower-priority requests when the
        replica is short (preempt.py)."""
        slack, block = self.limits.tree_slack_tokens, self.pool.block_size
        for r in self._bound(replica_index):
            if r.finish_reason is not None or not r.decoding or r.replica is None:
                continue
            if math.ceil((r.committed + slack) / block) <= r.kv_blocks:
                continue
            replica = self.pool.targets[r.replica]
            want = self.reserve_blocks_for(r.committed, r.remaining) - r.kv_blocks
            free = replica.total_blocks - replica.reserved_blocks
            if want > free:
                best = self.scheduler.admission.best_effort if self.scheduler.admission is not None else set()
                holders = [Holder(x.rid, x.kv_blocks, x.rid in best, x.admitted_at or 0.0)
                           for x in self._bound(replica_index) if x.finish_reason is None]
                for rid in victims(holders, r.rid, want, free):
                    self._preempt(self.requests[rid])
                if r.replica is None:  # it was the one preempted
                    continue
            replica.reserved_blocks += want
            r.kv_blocks += want

    def _preempt(self, r: GenRequest) -> None:
        """Give its KV back on both services and queue it again at the head; it keeps its tokens."""
        assert r.replica is not None
        replica = self.pool.targets[r.replica]
        self._unbind(r)
        if r.draft_seen:
            self._resync_draft(r)
        r.replica, r.prefilled, r.out_of_blocks = None, 0, 0
        r.resuming = bool(r.output)
        r.kv_blocks = self.reserve_blocks_for(len(r.context), r.remaining)
        self.waiting.insert(0, r)
        self.metrics.on_preempted()
        log.info("preempted %s (%d tokens kept) to free KV on target %d", r.rid, len(r.output), replica.index)

    # ---- 2. snapshot -----------------------------------------------------------------------------
    def _snapshot(self, replica: int, now: float) -> SchedulerView:
        """The waiting queue and `replica`'s requests as they are now; while requests wait, the other
        replicas' requests too, as their loops' last snapshots saw them (less those that have ended or
        moved since), for admission to weigh every replica's load."""
        waiting = [WaitingView(r.rid, len(r.context), r.remaining, r.kv_blocks, r.slo.name, r.slo.tpot_ms,
                               r.slo.ttft_ms, (now - r.arrival) * 1e3, r.best_effort_ok or r.resuming)
                   for r in self.waiting]  # a preempted request is never refused: it has streamed already
        prefilling: list[PrefillView] = []
        decoding: list[RequestView] = []
        for r in self._bound(replica):
            if r.decoding:
                decoding.append(RequestView(r.rid, r.slo.name, r.slo.tpot_ms, r.slo.ttft_ms, len(r.output) - 1,
                                            (now - r.token_times[0]) * 1e3, r.remaining, r.accepted, replica,
                                            len(r.draft_unsent), r.kv_blocks))
            elif r.prefilled < len(r.context):
                prefilling.append(PrefillView(r.rid, replica, len(r.context), r.prefilled, r.slo.name,
                                              r.slo.tpot_ms, r.slo.ttft_ms, (now - r.arrival) * 1e3))
        self._views[replica] = (decoding, prefilling)
        if self.waiting and len(self._views) > 1:  # admission weighs every replica's load
            decoding, prefilling = list(decoding), list(prefilling)
            for other, (dec, pre) in self._views.items():
                if other != replica:
                    decoding += [v for v in dec if self._still_on(v.rid, other)]
                    prefilling += [v for v in pre if self._still_on(v.rid, other)]
        draft = self.pool.draft.view() if self.pool.draft is not None else DraftView(False, False)
        lim = self.limits
        return SchedulerView(waiting, prefilling, decoding, [t.view() for t in self.pool.targets], draft,
                             Limits(lim.max_running, lim.max_prefill_tokens, lim.draft_max_depth,
                                    lim.draft_max_width), replica=replica, live=self.running.keys())

    def _still_on(self, rid: str, replica: int) -> bool:
        r = self.requests.get(rid)
        return r is not None and r.replica == replica

    # ---- 3. admission ----------------------------------------------------------------------------
    def _apply_admission(self, plan: IterationPlan) -> None:
        now = time.perf_counter()
        admission = self.scheduler.admission
        if admission is not None:
            for outcome in ADMISSION_OUTCOMES:
                self.metrics.on_admission(outcome, getattr(admission.last, outcome))
        for rid in plan.preempt:  # best effort giving its KV to SLO requests admitted below
            self._preempt(self.requests[rid])
        for rid, reject in plan.rejected.items():
            r = self.requests[rid]
            self.metrics.on_error("rejected")
            self._finish(r, "rejected", reject.reason, retry_after_s=reject.retry_after_s)
        for a in plan.admitted:
            r = self.requests[a.rid]
            assert a.replica is not None
            replica = self.pool.targets[a.replica]
            self.waiting.remove(r)
            self._bind(r, a.replica)
            r.admitted_at = now
            if admission is not None and a.rid in admission.best_effort:
                r.served_best_effort = True
            replica.requests.add(r.rid)
            replica.reserved_blocks += r.kv_blocks
            self._wake(a.replica)  # its loop prefills it
            r.events.put_nowait(Admitted(a.replica))
            self.metrics.on_admitted(now - r.arrival)

    # ---- 4. the draft ----------------------------------------------------------------------------
    async def _transition(self, plan: IterationPlan, record: IterationRecord) -> None:
        result = await self.executor.transition(plan.residency)
        record.draft.transition, record.draft.transition_ms = plan.residency.value, result.ms
        if result.failure is not None:
            record.draft.failure = str(result.failure)
            log.warning("draft %s failed: %s", plan.residency.value, result.failure)
            if result.failure.kind == "down":
                self._draft_lost()

    async def _speculate(self, plan: IterationPlan, decoding: list[GenRequest],
                         record: IterationRecord) -> dict[str, CandidateTree]:
        """The draft's trees of the requests it answered; a request without one verifies its root alone."""
        trees: dict[str, CandidateTree] = {}
        draft = self.pool.draft
        items = [self._speculate_item(r, plan) for r in decoding if plan.shapes[r.rid].depth > 0]
        if not items or draft is None or not draft.up:
            return trees
        epochs = {r.rid: r.draft_epoch for r in decoding}
        result = await self.executor.speculate(items, decoding[0].replica or 0)
        record.draft.requests, record.draft.call_ms = len(items), result.ms
        record.draft.lag = sum(len(item.new_tokens) for item in items)
        if result.value is None:
            self._draft_failed(result.failure, [r for r in decoding if plan.shapes[r.rid].depth > 0], record)
            return trees
        candidates, reply = result.value
        record.draft.service_ms = min(reply.total_ms, result.ms)
        record.draft.catchup_ms, record.draft.beam_ms = reply.catchup_ms, reply.beam_ms
        self._take_candidates(candidates, items, epochs, trees)
        return trees

    def _speculate_item(self, r: GenRequest, plan: IterationPlan) -> SpeculateItem:
        shape = plan.shapes[r.rid]
        r.draft_seen = True
        item = SpeculateItem(r.rid, draft_step(plan.step), list(r.draft_unsent), r.committed, shape.depth,
                             shape.width)
        if r.features is not None and self._reads_features():
            item.feature_start, item.features = r.features_sent, r.features.read(r.features_sent)
        return item

    def _reads_features(self) -> bool:
        """The draft drafts from the target's features: the passes return them, the draft calls carry them."""
        draft = self.pool.draft
        return draft is not None and draft.up and draft.reads_features

    # ---- 4b. drafting ahead (--overlap) ---------------------------------------------------------------
    def _held_trees(self, plan: IterationPlan, decoding: list[GenRequest]) -> dict[str, CandidateTree]:
        """The trees drafted ahead during the last pass, cut to this plan's depth; a request without one
        (a miss), or that the policy now gives d = 0, verifies its root alone."""
        trees: dict[str, CandidateTree] = {}
        for r in decoding:
            tree, r.ahead = r.ahead, None
            depth = plan.shapes[r.rid].depth
            if tree is not None and depth > 0:
                trees[r.rid] = tree if max(tree.depths) <= depth else reroot(tree, 0, depth)
        return trees

    def _ahead_items(self, plan: IterationPlan, decoding: list[GenRequest], trees: dict[str, CandidateTree],
                     selected: dict[str, list[int]]) -> dict[str, tuple[Guess, SpeculateItem]]:
        """Per request that speculates: the guess of its answer and the draft entry growing its next tree
        from that guess (depth d + 1: the first level is the guess of the bonus token)."""
        draft = self.pool.draft
        if draft is None or not draft.up:
            return {}
        out: dict[str, tuple[Guess, SpeculateItem]] = {}
        for r in decoding:
            shape = plan.shapes[r.rid]
            if shape.depth <= 0:
                continue
            tree = trees.get(r.rid)
            path = assumed_path(tree, selected.get(r.rid, [0])) if tree is not None else []
            depth = min(shape.depth + 1, self.limits.draft_max_depth)
            r.draft_seen = True
            out[r.rid] = (Guess(path, path[-1] if path else r.output[-1], len(r.output)),
                          SpeculateItem(r.rid, draft_step(plan.step, beside=True), [*r.draft_unsent, *path],
                                        r.committed, depth, shape.width, len(path)))
        return out

    def _take_ahead(self, ahead: dict[str, tuple[Guess, SpeculateItem]], drafted: dict[str, CandidateTree],
                    record: IterationRecord) -> None:
        """After the commit: a request whose answer matched its guess keeps its next tree."""
        for rid, (guess, _) in ahead.items():
            tree, r = drafted.get(rid), self.requests.get(rid)
            if tree is None or r is None or r.finish_reason is not None or r.replica is None:
                continue
            r.ahead = next_tree(guess, tree, r.output[guess.output_len:])
            record.draft.ahead_hits += r.ahead is not None

    def _take_candidates(self, candidates: list[Candidate], items: list[SpeculateItem], epochs: dict[str, int],
                         trees: dict[str, CandidateTree] | None, roots: dict[str, int] | None = None) -> None:
        """epochs: each request's `draft_epoch` when its entry was built (one whose draft state was rebuilt
        while the call ran, by another replica's loop, takes nothing from it); roots: the root each tree
        must have where it is not the request's newest token (drafting ahead)."""
        sent = {i.rid: len(i.new_tokens) - i.assumed for i in items}
        features_to = {i.rid: i.feature_start + len(i.features) for i in items if i.features is not None}
        for cand in candidates:
            r = self.requests.get(cand.rid)
            if r is None or r.finish_reason is not None or r.draft_epoch != epochs.get(cand.rid):
                continue
            root = roots.get(cand.rid, r.output[-1]) if roots else r.output[-1]
            if cand.error is not None or not cand.tokens or cand.tokens[0] != root:
                log.warning("draft refused %s (%s): rebuilding its draft state", r.rid, cand.error)
                self._resync_draft(r)
                continue
            del r.draft_unsent[: sent[cand.rid]]
            r.features_sent = features_to.get(cand.rid, r.features_sent)
            if trees is not None:
                trees[cand.rid] = CandidateTree(cand.tokens, cand.parents, cand.path_prob)

    def _draft_failed(self, failure: Failure | None, requests: list[GenRequest], record: IterationRecord) -> None:
        record.draft.failure = str(failure)
        if failure is not None and failure.kind == "down":
            log.error("draft call failed (%s): speculation is off until it is back", failure)
            self._draft_lost()
        else:
            log.error("draft refused the call (%s): plain decoding this step; rebuilding these requests' "
                      "draft state", failure)
            for r in requests:
                self._resync_draft(r)

    def _draft_lost(self) -> None:
        """The draft is gone (or restarted empty): every request rebuilds its draft state."""
        for r in self.running.values():
            if r.draft_seen:
                self._resync_draft(r)

    def _resync_draft(self, r: GenRequest) -> None:
        """Forget the draft's copy: release it there and resend every committed token next time."""
        r.draft_unsent = r.prompt + r.output if r.output else []
        r.features_sent = 0
        r.draft_epoch += 1
        r.ahead = None
        if self.pool.draft is not None:
            self.pool.draft.owed_releases.add(r.rid)

    # ---- 5. selection and the passes -------------------------------------------------------------
    def _passes(self, plan: IterationPlan, replica: int, mine: list[GenRequest], decoding: list[GenRequest],
                trees: dict[str, CandidateTree], record: IterationRecord) -> tuple[list[TargetPass],
                                                                                   dict[str, list[int]]]:
        """The replica's pass (none when it has nothing to do), and the tree nodes selected per request
        (root included). `mine`: the requests bound to it (the plan's chunks for other replicas' requests
        are theirs to run)."""
        selected: dict[str, list[int]] = {}
        if trees:  # a replica whose requests all have their root alone has nothing to select
            decoding_of = {r.rid: r for r in decoding}
            for batch in plan.batches:
                if batch.replica != replica or not any(r.rid in trees for r in batch.requests):
                    continue
                group = {r.rid: trees.get(r.rid) or CandidateTree.root_only(decoding_of[r.rid].output[-1])
                         for r in batch.requests if r.rid in decoding_of}
                model = self.pool.targets[batch.replica].cost
                selected.update(self.policy.select(batch, group, model))
        by_replica: dict[int, TargetPass] = {}

        def pass_of(replica: int) -> TargetPass:
            if replica not in by_replica:
                by_replica[replica] = TargetPass(self.pool.targets[replica], [], [], features=self._reads_features())
            return by_replica[replica]

        for r in mine:
            n = plan.chunks.get(r.rid, 0)
            if n <= 0 or r.finish_reason is not None:
                continue
            assert r.replica is not None
            context = r.context
            toks = context[r.prefilled: r.prefilled + n]
            last = r.prefilled + n == len(context)
            pass_of(r.replica).prefill.append(PrefillItem(r.rid, plan.step, r.prefilled, toks, last,
                                                          r.sampling if r.prefilled == 0 else None,
                                                          r.output[-1] if last and r.resuming else None))
            record.requests.append(RequestStep(r.rid, r.replica, prompt_tokens=n))
        for r in decoding:
            assert r.replica is not None
            tree = trees.get(r.rid)
            toks, parents = tree.subtree(selected.get(r.rid, [0])) if tree is not None else ([r.output[-1]], [-1])
            pass_of(r.replica).verify.append(VerifyItem(r.rid, plan.step, r.committed, toks, parents))
            shape = plan.shapes[r.rid]
            record.requests.append(RequestStep(r.rid, r.replica, depth=shape.depth, width=shape.width,
                                               verified=len(toks)))
        # (replicas that went down were handled after the releases; only draft calls ran since)
        return [by_replica[i] for i in sorted(by_replica) if by_replica[i].replica.up], selected

    async def _target_pass(self, plan: IterationPlan, passes: list[TargetPass], record: IterationRecord,
                           ahead: dict[str, tuple[Guess, SpeculateItem]]) -> None:
        """The passes, and beside them one draft call: the eager sync's d = 0 entries and, with --overlap,
        the entries drafting ahead."""
        sync_reqs = [r for rid in plan.draft_sync if (r := self.running.get(rid)) is not None and r.draft_unsent]
        draft = self.pool.draft
        sync = [self._speculate_item(r, plan) for r in sync_reqs] if draft is not None and draft.up else []
        for item in sync:
            item.step, item.depth, item.width = draft_step(plan.step, beside=True), 0, 1
        beside = sync + [item for _, item in ahead.values()]
        epochs = {i.rid: self.requests[i.rid].draft_epoch for i in beside}
        results, sync_result, phase_ms = await self.executor.target_pass(passes, beside)
        record.target_phase_ms = phase_ms
        drafted: dict[str, CandidateTree] = {}
        if sync_result is not None:
            record.draft.sync_requests, record.draft.ahead = len(sync), len(ahead)
            record.draft.sync_call_ms = sync_result.ms
            if sync_result.value is None:
                self._draft_failed(sync_result.failure, sync_reqs + [self.requests[rid] for rid in ahead
                                                                     if rid in self.requests], record)
            else:
                record.draft.sync_service_ms = sync_result.value[1].total_ms
                self._take_candidates(sync_result.value[0], beside, epochs, drafted,
                                      {rid: guess.root for rid, (guess, _) in ahead.items()})
        steps = {s.rid: s for s in record.requests}
        now = time.perf_counter()
        for p, result in zip(passes, results):
            step = ReplicaStep(p.replica.index, sum(len(i.tokens) for i in p.prefill),
                               sum(len(i.tokens) for i in p.verify), call_ms=result.ms)
            record.replicas.append(step)
            if result.value is None:
                step.failure = str(result.failure)
                self._replica_failed(p, result.failure)
                continue
            outputs, reply = result.value
            step.service_ms, step.forward_ms = min(reply.total_ms, result.ms), reply.forward_ms
            p.replica.free_blocks = reply.free_blocks
            self._commit(outputs, {i.rid: len(i.tokens) for i in p.prefill}, steps, now)
        if drafted:
            self._take_ahead(ahead, drafted, record)

    def _end_replica_requests(self, replica: TargetReplica, why: str) -> None:
        ended = [self.requests[rid] for rid in sorted(replica.requests) if rid in self.requests]
        log.error("target %d (%s) failed (%s): ending its %d requests", replica.index, replica.address, why,
                  len(ended))
        for r in ended:
            self._finish(r, "error", f"the target service failed: {why}")

    def _replica_failed(self, p: TargetPass, failure: Failure | None) -> None:
        replica = p.replica
        if failure is not None and failure.kind == "down":
            self._end_replica_requests(replica, failure.message)
            return
        ids = [i.rid for i in p.prefill] + [i.rid for i in p.verify]
        log.error("target %d refused a call (%s): ending the %d requests in it", replica.index, failure, len(ids))
        for rid in ids:
            r = self.requests.get(rid)
            if r is not None:
                self.metrics.on_error("remote_error")
                self._finish(r, "error", f"the target service refused the step: {failure}")

    # ---- 6. commit -------------------------------------------------------------------------------
    def _commit(self, outputs: list[StepOutput], prefill_len: dict[str, int], steps: dict[str, RequestStep],
                now: float) -> None:
        for out in outputs:
            r = self.requests.get(out.rid)
            step = steps.get(out.rid)
            if r is None or r.finish_reason is not None or step is None:
                continue  # aborted while the call ran; released next iteration
            if out.error is not None:
                step.error = out.error.code
                if out.error.code == "out_of_blocks":
                    r.out_of_blocks += 1  # retried next iteration, but not forever
                    if r.out_of_blocks <= self.limits.max_out_of_blocks:
                        continue
                self.metrics.on_error(out.error.code)
                self._finish(r, "error", f"{out.error.code}: {out.error.message}")
                continue
            step.emitted = len(out.tokens)
            if out.features is not None:  # at the chunk's start, or at the verified tree's root
                r.features = r.features or FeatureLog()
                r.features.write(r.committed - 1 if step.verified else r.prefilled, out.features)
            if step.verified:
                step.accepted = out.num_accepted
                r.accepted.append(out.num_accepted)
                r.verified.append((self.step, step.verified))
            elif not out.tokens:  # a prompt chunk that was not the last
                r.prefilled += prefill_len[out.rid]
                continue
            elif r.resuming:  # its KV is rebuilt; the token it returned is the one it had
                r.resuming, r.prefilled, step.emitted = False, len(r.prompt), 0
                continue
            else:
                r.prefilled = len(r.prompt)
                self.metrics.on_first_token(now - r.arrival)
            self._emit(r, out.tokens, now)

    def _emit(self, r: GenRequest, tokens: list[int], now: float) -> None:
        first = not r.output
        keep, reason = [], None
        for t in tokens:
            if t in r.stop_ids:
                reason = "stop"
                break
            keep.append(t)
            if len(r.output) + len(keep) >= r.max_tokens:
                reason = "length"
                break
        if not first and keep:
            self.metrics.on_tokens(len(keep), now - r.token_times[-1])
        if first:  # the draft has seen nothing yet: its first call carries the prompt too
            r.draft_unsent = list(r.prompt)
        r.output.extend(keep)
        r.token_times.extend([now] * len(keep))
        r.draft_unsent.extend(keep)
        if keep:
            r.events.put_nowait(Tokens(keep))
        if reason is not None:
            self._finish(r, reason)

    # ---- 7. the record's consumers ---------------------------------------------------------------
    def _consume(self, record: IterationRecord, replica: TargetReplica) -> None:
        if not record.replicas:
            self._set_load()
            return
        self.metrics.on_iteration(record)
        replica.cost.observe_record(record, replica.index, replica.reserved_blocks)  # its own passes only
        self.policy.observe(record)
        if self.scheduler.admission is not None:
            self.scheduler.admission.observe(record)
        self._set_load(replica)

    def _set_load(self, only: TargetReplica | None = None) -> None:
        """The load gauges: running, waiting and the KV in use over all replicas, and each replica's own
        series (`only`: just that replica's; the supervisor refreshes them all every second)."""
        used = total = 0
        for t in self.pool.targets:
            t_used = t.total_blocks - t.free_blocks if t.up and t.total_blocks else 0
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
        self.metrics.set_load(len(self.running), len(self.waiting), used / total if total else 0.0)


def draft_step(step: int, beside: bool = False) -> int:
    """The step number of a draft entry: an iteration may call the draft for a request twice with --overlap
    (its tree before the pass, the next one beside it), and the draft wants them strictly increasing."""
    return 2 * step + beside


__all__ = ["Engine", "EngineLimits", "ServiceUnavailable", "TargetReplica"]
