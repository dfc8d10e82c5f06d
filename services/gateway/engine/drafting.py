"""DraftCalls: the engine's calls to the draft service and what their answers change.

Per iteration: the draft's residency when the plan changes it (`transition`), the trees of the
requests the plan gives d > 0 (`speculate`: one call; with `--overlap` only the misses, or none),
and the d = 0 entries of the eager sync (`sync_items`, sent beside the target pass). Each entry
carries the committed tokens the draft has not seen and, for a draft that reads them, the target's
features it lacks. A refused entry or call rebuilds those requests' draft state (`resync`); a draft
that cannot be reached pauses speculation until the supervisor reconnects it.
"""

from __future__ import annotations

import logging

from specserve.gateway.backends.executor import Executor, Failure
from specserve.gateway.backends.pool import ServicePool
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.engine.table import RequestTable
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import IterationPlan
from specserve.gateway.sched.policy import CandidateTree
from specserve.shared.wire.service_client import Candidate, SpeculateItem

log = logging.getLogger("specserve.gateway")


def draft_step(step: int, beside: bool = False) -> int:
    """The step number of a draft entry: an iteration may call the draft for a request twice with --overlap
    (its tree before the pass, the next one beside it), and the draft wants them strictly increasing."""
    return 2 * step + beside


class DraftCalls:
    def __init__(self, table: RequestTable, pool: ServicePool, executor: Executor):
        self.table, self.pool, self.executor = table, pool, executor

    @property
    def reads_features(self) -> bool:
        """The draft drafts from the target's features: the passes return them, the draft calls carry them."""
        draft = self.pool.draft
        return draft is not None and draft.up and draft.reads_features

    @property
    def usable(self) -> bool:
        return self.pool.draft is not None and self.pool.draft.up

    @property
    def max_depth(self) -> int:
        """The deepest tree the draft accepts (0 while none is up: nothing is drafted)."""
        return self.pool.draft.max_depth if self.pool.draft is not None and self.pool.draft.up else 0

    async def transition(self, plan: IterationPlan, record: IterationRecord) -> None:
        """Offload or reload the draft's weights, as the plan says."""
        result = await self.executor.transition(plan.residency)
        record.draft.transition, record.draft.transition_ms = plan.residency.value, result.ms
        if result.failure is not None:
            record.draft.failure = str(result.failure)
            log.warning("draft %s failed: %s", plan.residency.value, result.failure)
            if result.failure.kind == "down":
                self.lost()

    async def speculate(self, plan: IterationPlan, decoding: list[GenRequest], record: IterationRecord,
                        items: list[SpeculateItem] | None = None,
                        roots: dict[str, int] | None = None) -> dict[str, CandidateTree]:
        """The draft's trees of the requests it answered; a request without one verifies its root alone.
        `items`: the entries where not each one `item` (a pass sent ahead: engine/ahead.py), `roots` the root of
        each tree that does not grow from its request's newest token (`take`)."""
        trees: dict[str, CandidateTree] = {}
        speculating = [r for r in decoding if plan.shapes[r.rid].depth > 0]
        if not speculating or not self.usable:
            return trees
        items = [self.item(r, plan) for r in speculating] if items is None else items
        if not items:
            return trees
        epochs = {r.rid: r.draft_epoch for r in decoding}
        result = await self.executor.speculate(items, decoding[0].replica or 0)
        record.draft.requests, record.draft.call_ms = len(items), result.ms
        record.draft.lag = sum(len(item.new_tokens) for item in items)
        if result.value is None:
            self.failed(result.failure, speculating, record)
            return trees
        candidates, reply = result.value
        record.draft.service_ms = min(reply.total_ms, result.ms)
        record.draft.catchup_ms, record.draft.beam_ms = reply.catchup_ms, reply.beam_ms
        record.draft.warmup = reply.warmup
        self.take(candidates, items, epochs, trees, roots)
        return trees

    def ahead_items(self, plan: IterationPlan,
                    decoding: list[GenRequest]) -> tuple[list[SpeculateItem], dict[str, int]]:
        """The entries for a pass sent ahead (engine/ahead.py), and the root of each tree drafted on a guess: a
        request with nothing in flight drafts from its root; one with an entry in flight drafts from the end of
        that entry's chain, assumed accepted (`SentAhead.path`), one level deeper (the first level guesses its
        bonus token). Where that chain is not known yet, or the draft reads the target's features (the assumed
        tokens have none), it drafts nothing."""
        items: list[SpeculateItem] = []
        roots: dict[str, int] = {}
        for r in decoding:
            shape = plan.shapes[r.rid]
            if shape.depth <= 0:
                continue
            sent = r.sent_ahead if r.ahead_step else None
            if sent is None:
                items.append(self.item(r, plan))
                continue
            path = sent.path
            if path is None or self.reads_features:
                continue
            item = self.item(r, plan)
            item.new_tokens += path
            item.assumed, item.depth = len(path), min(shape.depth + 1, self.max_depth)
            roots[r.rid] = path[-1] if path else r.output[-1]
            items.append(item)
        return items, roots

    def sync_items(self, plan: IterationPlan) -> tuple[list[GenRequest], list[SpeculateItem]]:
        """The eager sync: the d = 0 entries (committed tokens only) of the requests the plan names."""
        reqs = [r for rid in plan.draft_sync if (r := self.table.running.get(rid)) is not None and r.draft_unsent]
        if not self.usable:
            return reqs, []
        items = [self.item(r, plan) for r in reqs]
        for item in items:
            item.step, item.depth, item.width = draft_step(plan.step, beside=True), 0, 1
        return reqs, items

    def item(self, r: GenRequest, plan: IterationPlan) -> SpeculateItem:
        """A request's entry: the committed tokens the draft lacks, and the features it lacks."""
        shape = plan.shapes[r.rid]
        r.draft_seen = True
        item = SpeculateItem(r.rid, draft_step(plan.step), list(r.draft_unsent), r.committed, shape.depth,
                             shape.width)
        if r.features is not None and self.reads_features:
            item.feature_start, item.features = r.features_sent, r.features.read(r.features_sent)
        return item

    def take(self, candidates: list[Candidate], items: list[SpeculateItem], epochs: dict[str, int],
             trees: dict[str, CandidateTree] | None, roots: dict[str, int] | None = None) -> None:
        """Each answered entry: what the draft has now seen, and its tree into `trees`. epochs: each
        request's `draft_epoch` when its entry was built (one whose draft state was rebuilt while the
        call ran, by another replica's loop, takes nothing from it); roots: the root each tree must have
        where it is not the request's newest token (drafting ahead)."""
        sent = {i.rid: len(i.new_tokens) - i.assumed for i in items}
        features_to = {i.rid: i.feature_start + len(i.features) for i in items if i.features is not None}
        for cand in candidates:
            r = self.table.requests.get(cand.rid)
            if r is None or r.finish_reason is not None or r.draft_epoch != epochs.get(cand.rid):
                continue
            root = roots.get(cand.rid, r.output[-1]) if roots else r.output[-1]
            if cand.error is not None or not cand.tokens or cand.tokens[0] != root:
                log.warning("draft refused %s (%s): rebuilding its draft state", r.rid, cand.error)
                self.resync(r)
                continue
            del r.draft_unsent[: sent[cand.rid]]
            r.features_sent = features_to.get(cand.rid, r.features_sent)
            if trees is not None:
                trees[cand.rid] = CandidateTree(cand.tokens, cand.parents, cand.path_prob)

    def failed(self, failure: Failure | None, requests: list[GenRequest], record: IterationRecord) -> None:
        """A draft call that failed whole: down (speculation pauses) or refused (these requests resync)."""
        record.draft.failure = str(failure)
        if failure is not None and failure.kind == "down":
            log.error("draft call failed (%s): speculation is off until it is back", failure)
            self.lost()
        else:
            log.error("draft refused the call (%s): plain decoding this step; rebuilding these requests' "
                      "draft state", failure)
            for r in requests:
                self.resync(r)

    def lost(self) -> None:
        """The draft is gone (or restarted empty): every request rebuilds its draft state."""
        for r in self.table.running.values():
            if r.draft_seen:
                self.resync(r)

    def resync(self, r: GenRequest) -> None:
        """Forget the draft's copy: release it there and resend every committed token next time."""
        r.draft_unsent = r.prompt + r.output if r.output else []
        r.features_sent = 0
        r.draft_epoch += 1
        r.next_tree = None
        if self.pool.draft is not None:
            self.pool.draft.owed_releases.add(r.rid)


__all__ = ["DraftCalls", "draft_step"]
