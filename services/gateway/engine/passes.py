"""Passes: one replica's target pass, built from the plan and the trees, run, and committed.

`constrain` shapes the trees of requests with a grammar (engine/constrain.py). `build` asks the policy
which nodes of each batch's trees to verify and puts the replica's prompt chunks and selected subtrees
(with their grammar's masks, and its forced tokens whatever the policy chose) into one `TargetPass`,
with the releases the replica is owed (`Forward.release`: freed before the pass, owed again if the call
fails). `run` sends it, and beside it one draft call (the eager sync's d = 0 entries and, with
--overlap, the entries drafting ahead); then it commits each replica's outputs and keeps the trees
whose guess was right. A replica that refuses a call ends the requests in its pass; one that cannot be
reached is handed to `Admitter.replica_lost` (its requests move to another replica, or end).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from specserve.gateway.backends.executor import Executor, Failure, TargetPass
from specserve.gateway.backends.pool import ServicePool, TargetReplica
from specserve.gateway.engine.ahead import decode_entry, queued_ms
from specserve.gateway.engine.commit import Commit
from specserve.gateway.engine.drafting import DraftCalls
from specserve.gateway.engine.overlap import Guess, keep_hits
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.engine.table import RequestTable
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.perf.record import IterationRecord, ReplicaStep, RequestStep
from specserve.gateway.sched.plan import IterationPlan
from specserve.gateway.sched.policy import CandidateTree, Policy
from specserve.shared.wire.service_client import PrefillItem, SpeculateItem, VerifyItem

log = logging.getLogger("specserve.gateway")


class Passes:
    def __init__(self, table: RequestTable, pool: ServicePool, executor: Executor, policy: Policy,
                 drafts: DraftCalls, metrics: GatewayMetrics, replica_lost: Callable[[TargetReplica, str], None],
                 forced_tokens: int = 0):
        self.table, self.pool, self.executor, self.policy = table, pool, executor, policy
        self.drafts, self.metrics = drafts, metrics
        self.replica_lost = replica_lost  # a replica that cannot be reached (Admitter.replica_lost)
        self.forced_tokens = forced_tokens  # a grammar's forced tokens put into a tree per pass (--forced-tokens)
        self.commit = Commit(table, metrics)
        self.replied: dict[int, float] = {}  # per replica: when its last Forward was answered (perf_counter s)

    def constrain(self, replica: int, decoding: list[GenRequest],
                  trees: dict[str, CandidateTree]) -> dict[str, CandidateTree]:
        """The trees with each grammar request's shaped by its grammar (engine/constrain.py): forced tokens
        grafted, forbidden nodes pruned, masks computed. A request with a grammar and no tree gets one
        where its grammar forces tokens. The forced tokens of one pass are at most its budget B, beside
        the nodes the policy selects within it."""
        out, room = trees, self.pool.targets[replica].cost.budget_tokens
        for r in decoding:
            if r.grammar is None:
                continue
            tree = trees.get(r.rid) or CandidateTree.root_only(r.output[-1])
            shaped = r.grammar.shape(tree, min(self.forced_tokens, r.remaining - 1, room))
            room -= len(r.grammar.shaped.forced) if r.grammar.shaped is not None else 0
            if r.rid in trees or len(shaped.tokens) > 1:
                out = out if out is not trees else dict(trees)
                out[r.rid] = shaped
        return out

    def build(self, plan: IterationPlan, replica: int, mine: list[GenRequest], decoding: list[GenRequest],
              trees: dict[str, CandidateTree], record: IterationRecord, sent_ahead: bool = False,
              placeholders: dict[str, int] | None = None) -> tuple[TargetPass | None, dict[str, list[int]]]:
        """The replica's pass (None when it has nothing to do, or is down), and the tree nodes selected
        per request (root included). `mine`: the requests bound to it (the plan's chunks for other
        replicas' requests are theirs to run). `sent_ahead`: the pass goes before the one in flight is
        committed (engine/ahead.py: a decode entry's root, and its tree where drafted on a guess, under its
        `placeholders` root, wait on the pass in flight; a request's next chunk starts where its chunk in
        flight ends, and none follows its last)."""
        selected = self._select(plan, replica, decoding, trees)
        target = self.pool.targets[replica]
        p = TargetPass(target, [], [], features=self.drafts.reads_features)
        for r in mine:
            n = plan.chunks.get(r.rid, 0)
            context = r.context
            start = r.chunk_end if sent_ahead and r.chunk_step else r.prefilled  # after its chunk in flight
            if n <= 0 or r.finish_reason is not None or start >= len(context):
                continue  # (or a prompt finished by a pass committed since the plan was made)
            # a first chunk covers what its replica's prefix cache is expected to hold (r.cached), then n more
            end = min(max(start, r.cached) + n, len(context))
            last = end == len(context)
            if sent_ahead:
                r.chunk_step, r.chunk_end = plan.step, end
            mask = r.grammar.first_mask() if last and not r.resuming and r.grammar is not None else None
            p.prefill.append(PrefillItem(r.rid, plan.step, start, context[start: end], last,
                                         r.prefill_sampling if start == 0 else None,
                                         r.output[-1] if last and r.resuming else None, mask))
            record.requests.append(RequestStep(r.rid, replica, prompt_tokens=n))
        for r in decoding:
            tree = trees.get(r.rid)
            if sent_ahead:  # root-only or a chain (ahead.runs_ahead)
                toks, parents = tree.subtree(selected.get(r.rid, [0])) if tree is not None else ([r.output[-1]], [-1])
                sent = decode_entry(r, plan.step, toks, parents, (placeholders or {}).get(r.rid))
                if sent is not None:
                    p.verify.append(VerifyItem(r.rid, plan.step, sent.base, sent.tokens, sent.parents, None,
                                               sent.pending, sent.guess))
                    drafted = len(sent.tokens) > 1  # (where pending: its placeholder root is not verified)
                    sent.entry = RequestStep(r.rid, replica, depth=plan.shapes[r.rid].depth if drafted else 0,
                                             verified=len(sent.tokens) - (sent.pending and drafted),
                                             filler=self.policy.filler(r.rid) if drafted else 0)
                    record.requests.append(sent.entry)
                    if sent.pending and drafted:
                        sent.counts = record.draft
                        record.draft.guessed += 1
                continue
            drafted, nodes, masks = tree is not None, selected.get(r.rid, [0]), None
            if r.grammar is not None:
                shaped = r.grammar.take_shaped(tree, r.output[-1])
                tree = shaped.tree
                if shaped.forced:  # forced tokens are verified whatever the policy chose
                    nodes = selected[r.rid] = sorted(set(nodes) | set(shaped.forced))
                masks = shaped.rows(nodes)
            toks, parents = tree.subtree(nodes) if tree is not None else ([r.output[-1]], [-1])
            p.verify.append(VerifyItem(r.rid, plan.step, r.committed, toks, parents, masks))
            shape = plan.shapes[r.rid]
            filler = self.policy.filler(r.rid) if drafted else 0
            record.requests.append(RequestStep(r.rid, replica, depth=shape.depth, width=shape.width,
                                               verified=len(toks), filler=filler))
        # (a replica that went down was handled after the releases; only draft calls ran since)
        if not (p.prefill or p.verify) or not target.up:
            return None, selected
        # what it is owed goes with the pass (freed before it); owed again if the call fails
        p.release = sorted(target.owed_releases)
        target.owed_releases.clear()
        return p, selected

    def _select(self, plan: IterationPlan, replica: int, decoding: list[GenRequest],
                trees: dict[str, CandidateTree]) -> dict[str, list[int]]:
        """The policy's choice of nodes to verify in each of this replica's batches."""
        selected: dict[str, list[int]] = {}
        if not trees:  # a replica whose requests all have their root alone has nothing to select
            return selected
        decoding_of = {r.rid: r for r in decoding}
        for batch in plan.batches:
            if batch.replica != replica or not any(r.rid in trees for r in batch.requests):
                continue
            group = {r.rid: trees.get(r.rid) or CandidateTree.root_only(decoding_of[r.rid].output[-1])
                     for r in batch.requests if r.rid in decoding_of}
            selected.update(self.policy.select(batch, group, self.pool.targets[batch.replica].cost))
        return selected

    async def run(self, plan: IterationPlan, passes: list[TargetPass], record: IterationRecord,
                  ahead: dict[str, tuple[Guess, SpeculateItem]]) -> None:
        """The passes, and beside them one draft call: the eager sync's entries and those drafting ahead."""
        sync_reqs, sync = self.drafts.sync_items(plan)
        beside = sync + [item for _, item in ahead.values()]
        epochs = {i.rid: self.table.requests[i.rid].draft_epoch for i in beside}
        results, sync_result, phase_ms = await self.executor.target_pass(passes, beside)
        replied = time.perf_counter()
        queued = {p.replica.index: queued_ms(self.replied.get(p.replica.index, 0.0), replied, r.ms)
                  for p, r in zip(passes, results)}  # a pass sent ahead, in line behind the one before it
        self.replied.update((p.replica.index, replied) for p in passes)
        record.target_phase_ms = phase_ms - max(queued.values(), default=0.0)
        drafted: dict[str, CandidateTree] = {}
        if sync_result is not None:
            record.draft.sync_requests, record.draft.ahead = len(sync), len(ahead)
            record.draft.sync_call_ms = sync_result.ms
            if sync_result.value is None:
                self.drafts.failed(sync_result.failure, sync_reqs + [self.table.requests[rid] for rid in ahead
                                                                     if rid in self.table.requests], record)
            else:
                record.draft.sync_service_ms = sync_result.value[1].total_ms
                self.drafts.take(sync_result.value[0], beside, epochs, drafted,
                                 {rid: guess.root for rid, (guess, _) in ahead.items()})
        steps = {s.rid: s for s in record.requests}
        now = time.perf_counter()
        for p, result in zip(passes, results):
            step = ReplicaStep(p.replica.index, sum(len(i.tokens) for i in p.prefill),
                               sum(steps[i.rid].verified for i in p.verify),  # (as made true: ahead.resolve)
                               call_ms=result.ms - queued[p.replica.index])
            record.replicas.append(step)
            if result.value is None:
                step.failure = str(result.failure)
                p.replica.owed_releases.update(p.release)
                self._failed(p, result.failure)
                continue
            outputs, reply = result.value
            step.service_ms, step.forward_ms = min(reply.total_ms, result.ms), reply.forward_ms
            step.warmup = reply.warmup
            p.replica.free_blocks = reply.free_blocks
            step.prefill_tokens -= sum(o.num_cached for o in outputs)  # computed: the cached ones were not
            self.table.prefix.trim(p.replica, reply.cached_blocks)
            self.commit.outputs(outputs, {i.rid: len(i.tokens) for i in p.prefill}, steps, now, record.step)
        if drafted:
            keep_hits(self.table, ahead, drafted, record)

    def _failed(self, p: TargetPass, failure: Failure | None) -> None:
        replica = p.replica
        if failure is not None and failure.kind == "down":
            self.replica_lost(replica, failure.message)
            return
        ids = [i.rid for i in p.prefill] + [i.rid for i in p.verify]
        log.error("target %d refused a call (%s): ending the %d requests in it", replica.index, failure, len(ids))
        for rid in ids:
            r = self.table.requests.get(rid)
            if r is not None:
                self.metrics.on_error("remote_error")
                self.table.finish(r, "error", f"the target service refused the step: {failure}")


__all__ = ["Passes"]
