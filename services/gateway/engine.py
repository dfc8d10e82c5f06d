"""The gateway's step loop: admit, speculate, select, verify, stream.

One asyncio task runs iterations back to back while there is work. Each iteration:

1. releases finished and aborted requests in both services;
2. admits waiting requests while KV blocks and `max_running` allow (reserving prompt + max_tokens);
3. cuts prompt chunks within `max_prefill_tokens` (chunked prefill);
4. asks the policy for speculation shapes and calls the draft for the requests that get d > 0;
5. asks the policy which candidate nodes to verify;
6. sends the prefill chunks and the trees to the target in one call;
7. hands every request its emitted tokens (cut at EOS / max_tokens) and records timings.

Service failures never take the gateway down: a draft that fails is skipped (root-only trees,
plain decoding) and reconnected; each request's draft state is rebuilt from its tokens. A target
that fails ends the requests it held with an error; new requests get 503 until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from specserve.gateway.latency import LatencyModel
from specserve.gateway.metrics import GatewayMetrics
from specserve.gateway.policy import BatchView, CandidateTree, Outcome, Policy, RequestView
from specserve.gateway.request import Finished, GenRequest, Tokens
from specserve.shared.service_client import DraftClient, PrefillItem, SpeculateItem, TargetClient, VerifyItem

log = logging.getLogger("specserve.gateway")
RECONNECT_INTERVAL_S = 1.0
SERVICE_ERRORS = (ConnectionError, OSError, asyncio.IncompleteReadError, RuntimeError)


class ServiceUnavailable(Exception):
    """The target service cannot be reached: new requests get 503."""


class Engine:
    def __init__(self, policy: Policy, latency: LatencyModel, metrics: GatewayMetrics, draft_address: str,
                 target_address: str, *, max_running: int = 64, max_prefill_tokens: int = 256,
                 tree_slack_tokens: int = 64):
        self.policy, self.latency, self.metrics = policy, latency, metrics
        self.draft_address, self.target_address = draft_address, target_address
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.tree_slack_tokens = tree_slack_tokens  # KV reserved per request beyond prompt + max_tokens
        self.draft: DraftClient | None = None
        self.target: TargetClient | None = None
        self.total_blocks = 0
        self.block_size = 16
        self.free_blocks = 0  # target KV blocks free after the last call
        self.reserved_blocks = 0
        self.waiting: list[GenRequest] = []
        self.running: list[GenRequest] = []
        self.requests: dict[str, GenRequest] = {}
        self._release: set[str] = set()  # finished requests to release in both services
        self._draft_release: set[str] = set()  # requests whose draft state must be rebuilt
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._last_connect = 0.0
        self.step = 0

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._connect_target()
        if self.policy.uses_draft:
            await self._connect_draft()
        self.metrics.set_budget(self.latency.budget_tokens)
        self._task = asyncio.create_task(self._loop(), name="engine")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for r in list(self.requests.values()):
            self._finish(r, "abort")
        with contextlib.suppress(*SERVICE_ERRORS):
            await self._release_finished()
        for client in (self.draft, self.target):
            if client is not None:
                await client.close()

    async def _connect_target(self) -> None:
        self.target = await TargetClient.connect(self.target_address)
        stats = await self.target.stats()
        self.total_blocks, self.block_size, self.free_blocks = stats.total_blocks, stats.block_size, stats.free_blocks

    async def _connect_draft(self) -> None:
        self.draft = await DraftClient.connect(self.draft_address)
        await self.draft.health()

    async def _reconnect(self) -> None:
        now = time.monotonic()
        if now - self._last_connect < RECONNECT_INTERVAL_S:
            return
        self._last_connect = now
        if self.target is None:
            with contextlib.suppress(*SERVICE_ERRORS):
                await self._connect_target()
                log.info("target service reconnected at %s", self.target_address)
        if self.draft is None and self.policy.uses_draft:
            try:
                await self._connect_draft()
                log.info("draft service reconnected at %s", self.draft_address)
            except SERVICE_ERRORS:
                self.draft = None

    @property
    def target_up(self) -> bool:
        return self.target is not None

    # ---- requests --------------------------------------------------------------------------------
    def kv_blocks_for(self, prompt_tokens: int, max_tokens: int) -> int:
        return math.ceil((prompt_tokens + max_tokens + self.tree_slack_tokens) / self.block_size)

    def submit(self, req: GenRequest) -> None:
        if self.target is None:
            raise ServiceUnavailable("the target service is unavailable")
        req.kv_blocks = self.kv_blocks_for(len(req.prompt), req.max_tokens)
        self.requests[req.rid] = req
        self.waiting.append(req)
        self.metrics.on_queued()
        self._wake.set()

    def abort(self, rid: str, reason: str = "abort") -> None:
        """End a request early (client gone, or a stop string the handler found)."""
        req = self.requests.get(rid)
        if req is not None and req.finish_reason is None:
            self._finish(req, reason, notify=False)
            self._wake.set()

    def _finish(self, r: GenRequest, reason: str, error: str | None = None, notify: bool = True) -> None:
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        if r in self.waiting:
            self.waiting.remove(r)
        else:
            self._release.add(r.rid)
        if r in self.running:
            self.running.remove(r)
            self.reserved_blocks -= r.kv_blocks
        self.requests.pop(r.rid, None)
        if notify:
            r.events.put_nowait(Finished(reason, error))
        now = time.perf_counter()
        tpot = r.tpot_s()
        ok = r.slo_met() if reason in ("stop", "length") else None
        self.metrics.on_finished(reason, len(r.prompt), len(r.output), now - r.arrival, tpot, r.slo.name, ok)

    # ---- the loop --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not self.running and not self.waiting and not self._release:
                self._wake.clear()
                if self.target is None or (self.draft is None and self.policy.uses_draft):
                    with contextlib.suppress(TimeoutError):  # idle, but a service to reconnect
                        await asyncio.wait_for(self._wake.wait(), RECONNECT_INTERVAL_S)
                    await self._reconnect()
                else:
                    await self._wake.wait()
                continue
            try:
                await self._iteration()
            except Exception:  # a bug in one iteration must not stop serving
                log.exception("iteration %d failed; its requests are ended", self.step)
                for r in list(self.running):
                    self._finish(r, "error", "internal error in the gateway")
                await asyncio.sleep(0)

    async def _release_finished(self) -> None:
        rids, self._release = sorted(self._release), set()
        draft_rids = sorted(set(rids) | self._draft_release)
        self._draft_release = set()
        calls = []
        if rids and self.target is not None:
            calls.append(self.target.release(rids))
        if draft_rids and self.draft is not None:
            calls.append(self.draft.release(draft_rids))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("release failed: %s", result)

    def _admit(self) -> None:
        order = {rid: i for i, rid in enumerate(self.policy.admit([r.rid for r in self.waiting], self._batch([]),
                                                                   self.latency))}
        for r in sorted(self.waiting, key=lambda r: order.get(r.rid, len(order))):
            if len(self.running) >= self.max_running or self.reserved_blocks + r.kv_blocks > self.total_blocks:
                break
            self.waiting.remove(r)
            self.running.append(r)
            self.reserved_blocks += r.kv_blocks
            r.admitted_at = time.perf_counter()
            self.metrics.on_admitted(r.admitted_at - r.arrival)

    def _prefill_items(self, step: int) -> list[PrefillItem]:
        items, budget = [], self.max_prefill_tokens
        for r in self.running:
            if r.prefilled >= len(r.prompt) or r.finish_reason is not None or budget <= 0:
                continue
            toks = r.prompt[r.prefilled : r.prefilled + budget]
            budget -= len(toks)
            items.append(PrefillItem(r.rid, step, r.prefilled, toks, r.prefilled + len(toks) == len(r.prompt),
                                     r.sampling if r.prefilled == 0 else None))
        return items

    def _view(self, r: GenRequest, now: float) -> RequestView:
        return RequestView(r.rid, r.slo.name, r.slo.tpot_ms, r.slo.ttft_ms, len(r.output) - 1,
                           (now - r.token_times[0]) * 1e3, r.remaining, r.accepted)

    def _batch(self, decoding: list[GenRequest], prefill_tokens: int = 0) -> BatchView:
        now = time.perf_counter()
        return BatchView([self._view(r, now) for r in decoding], prefill_tokens, len(self.waiting),
                         self.draft is not None)

    async def _iteration(self) -> None:
        t0 = time.perf_counter()
        await self._reconnect()
        await self._release_finished()
        if self.target is None:
            for r in list(self.waiting):
                self._finish(r, "error", "the target service is unavailable")
            await asyncio.sleep(RECONNECT_INTERVAL_S)
            return
        self._admit()
        self.step += 1
        step = self.step
        prefill = self._prefill_items(step)
        decoding = [r for r in self.running if r.decoding]
        batch = self._batch(decoding, sum(len(p.tokens) for p in prefill))
        trees, draft_ms, draft_service_ms = await self._speculate(batch, decoding, step)
        selected = self.policy.select(batch, trees, self.latency) if decoding else {}
        verify = []
        for r in decoding:
            toks, parents = trees[r.rid].subtree(selected[r.rid])
            verify.append(VerifyItem(r.rid, step, r.committed, toks, parents))
        if not prefill and not verify:
            return
        t1 = time.perf_counter()
        try:
            outputs, reply = await self.target.forward(prefill, verify)
        except SERVICE_ERRORS as exc:
            log.error("target call failed (%s): ending %d requests", exc, len(self.running))
            self.target = None
            for r in list(self.running):
                self._finish(r, "error", f"the target service failed: {exc}")
            return
        target_ms = (time.perf_counter() - t1) * 1e3
        self.free_blocks = reply.free_blocks
        outcomes = self._commit(outputs, {p.rid: len(p.tokens) for p in prefill}, {v.rid: v for v in verify})
        total_ms = (time.perf_counter() - t0) * 1e3
        self._record(total_ms, draft_ms, target_ms, batch, verify, outcomes,
                     draft_service_ms, min(reply.total_ms, target_ms))
        if decoding:
            self.latency.observe(total_ms, draft_ms, target_ms)
            self.policy.observe(batch, outcomes, total_ms)

    async def _speculate(self, batch: BatchView, decoding: list[GenRequest], step: int):
        trees = {r.rid: CandidateTree.root_only(r.output[-1]) for r in decoding}
        if not decoding or not self.policy.uses_draft or self.draft is None:
            return trees, 0.0, 0.0
        plan = self.policy.plan(batch, self.latency)
        items = [SpeculateItem(r.rid, step, r.draft_unsent, r.committed, plan.shapes[r.rid].depth,
                               plan.shapes[r.rid].width) for r in decoding if plan.shapes[r.rid].depth > 0]
        if not items:
            return trees, 0.0, 0.0
        t0 = time.perf_counter()
        try:
            candidates, reply = await self.draft.speculate(items)
        except SERVICE_ERRORS as exc:
            log.error("draft call failed (%s): speculation is off until it is back", exc)
            self.draft = None
            for r in self.running:
                self._resync_draft(r)
            return trees, (time.perf_counter() - t0) * 1e3, 0.0
        by_rid = {r.rid: r for r in decoding}
        for cand in candidates:
            r = by_rid[cand.rid]
            if cand.error is not None or not cand.tokens or cand.tokens[0] != r.output[-1]:
                log.warning("draft refused %s (%s): rebuilding its draft state", r.rid, cand.error)
                self._resync_draft(r)
                continue
            r.draft_unsent = []
            trees[r.rid] = CandidateTree(cand.tokens, cand.parents, cand.path_prob)
        call_ms = (time.perf_counter() - t0) * 1e3
        return trees, call_ms, min(reply.total_ms, call_ms)

    def _resync_draft(self, r: GenRequest) -> None:
        """Forget the draft's copy: release it there and resend every committed token next time."""
        if r.output:
            r.draft_unsent = r.prompt + r.output
        self._draft_release.add(r.rid)

    def _commit(self, outputs, prefill_len: dict[str, int], verify: dict[str, VerifyItem]) -> list[Outcome]:
        now = time.perf_counter()
        outcomes = []
        for out in outputs:
            r = self.requests.get(out.rid)
            if r is None or r.finish_reason is not None:
                continue  # aborted while the call ran; released next iteration
            if out.error is not None:
                if out.error.code == "out_of_blocks":
                    continue  # retried next iteration
                self.metrics.on_error(out.error.code)
                self._finish(r, "error", f"{out.error.code}: {out.error.message}")
                continue
            if out.rid in verify:
                r.accepted.append(out.num_accepted)
                r.verified.append((self.step, len(verify[out.rid].tokens)))
                outcomes.append(Outcome(r.rid, len(verify[out.rid].tokens), out.num_accepted))
            elif not out.tokens:  # a prompt chunk that was not the last
                r.prefilled += prefill_len[out.rid]
                continue
            else:
                r.prefilled = len(r.prompt)
                self.metrics.on_first_token(now - r.arrival)
            self._emit(r, out.tokens, now)
        return outcomes

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
            gap = now - r.token_times[-1]
            self.metrics.on_tokens(len(keep), gap)
        if first:  # the draft has seen nothing yet: its first call carries the prompt too
            r.draft_unsent = list(r.prompt)
        r.output.extend(keep)
        r.token_times.extend([now] * len(keep))
        r.draft_unsent.extend(keep)
        if keep:
            r.events.put_nowait(Tokens(keep))
        if reason is not None:
            self._finish(r, reason)

    def _record(self, total_ms: float, draft_ms: float, target_ms: float, batch: BatchView,
                verify: list[VerifyItem], outcomes: list[Outcome], draft_service_ms: float,
                target_service_ms: float) -> None:
        """Split the iteration: inside the draft and target services, transport (the rest of those two
        calls), and scheduling (everything outside the calls)."""
        schedule_ms = max(0.0, total_ms - draft_ms - target_ms)
        transport_ms = (draft_ms - draft_service_ms) + (target_ms - target_service_ms)
        tree_tokens = sum(len(v.tokens) for v in verify)
        speculated = [o for o in outcomes if o.verified > 1]
        max_len = max((o.verified for o in speculated), default=1)
        per_pos = [sum(1 for o in speculated if o.accepted > i) for i in range(max_len - 1)]
        self.metrics.on_iteration(batch.prefill_tokens + tree_tokens, draft_service_ms / 1e3,
                                  target_service_ms / 1e3, schedule_ms / 1e3, len(speculated),
                                  sum(o.verified - 1 for o in speculated), sum(o.accepted for o in speculated),
                                  per_pos, transport_s=transport_ms / 1e3)
        kv = 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0
        self.metrics.set_load(len(self.running), len(self.waiting), kv)
