"""The one interface every speculation policy plugs into.

Each gateway iteration the scheduler (scheduler.py) asks the policy:

1. `decide(view) -> Decision`: the one decision hook. The view is a snapshot of the gateway (waiting,
   prefilling and decoding requests, the target replicas, the draft, the limits) holding the
   scheduler's FIFO proposal for admission and prompt chunks. The answer holds admissions (with
   replica hints), deferrals and rejections with reasons, prompt chunks, the speculation shape
   (d, w) of every decoding request and the draft's residency. The default accepts the proposal
   and asks `shapes` once per target replica, so most policies only write `shapes` and `select`.
2. `select(batch, candidates, model)`, once per replica after the draft call: which nodes of each
   request's candidate tree the target verifies (node 0, the root, always; closed under parents).
   A replica where the draft returned no tree (nobody speculated) is not asked: its requests verify
   their roots alone.

After the iteration, `observe(record)` gets the one `IterationRecord` (composition, per-request
shapes and acceptance, the time split) that metrics and the cost model read too. The
scheduler enforces the hard limits on whatever a policy decides. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import NO_DRAFT, BatchView, Decision, RequestView, Residency, SchedulerView, Shape
from specserve.gateway.sched.policy.goodput import expected_tokens


@dataclass(slots=True)
class CandidateTree:
    """The draft's candidate tree for one request: node 0 is the root (the newest committed token);
    parents precede children."""

    tokens: list[int]
    parents: list[int]  # -1 for the root
    path_prob: list[float]  # f̂(v): product of draft probabilities on the root-to-v path (1 for the root)
    depths: list[int] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not self.depths:
            self.depths = [0] * n
            for v in range(1, n):
                self.depths[v] = self.depths[self.parents[v]] + 1
        if not self.children:
            self.children = [[] for _ in range(n)]
            for v in range(1, n):
                self.children[self.parents[v]].append(v)

    @classmethod
    def root_only(cls, token: int) -> CandidateTree:
        return cls([token], [-1], [1.0], [0], [[]])  # depths and children given: nothing to derive

    def rerooted(self, root: int, depth: int | None = None) -> CandidateTree:
        """The subtree under node `root` (at most `depth` levels below it, if given) as a tree of its own:
        path probabilities become conditional on reaching `root`; parents still precede children."""
        keep = [root]
        index = {root: 0}
        parents = [-1]
        for v in range(root + 1, len(self.tokens)):
            p = self.parents[v]
            if p in index and (depth is None or self.depths[v] - self.depths[root] <= depth):
                index[v] = len(keep)
                keep.append(v)
                parents.append(index[p])
        base = self.path_prob[root] or 1.0
        return CandidateTree([self.tokens[v] for v in keep], parents,
                             [1.0] + [self.path_prob[v] / base for v in keep[1:]])

    def subtree(self, nodes: list[int]) -> tuple[list[int], list[int]]:
        """Tokens and re-indexed parents of a parent-closed node selection, in node order."""
        if len(nodes) == 1:  # the root alone (plain decoding): the common case
            return [self.tokens[0]], [-1]
        nodes = sorted(nodes)
        index = {v: i for i, v in enumerate(nodes)}
        return [self.tokens[v] for v in nodes], [index[self.parents[v]] if v else -1 for v in nodes]


Trees = dict[str, CandidateTree]  # candidate tree per request id
Selected = dict[str, list[int]]  # selected node indices per request id, sorted, root included


class Policy:
    """The base policy: no speculation (plain continuous batching), FIFO admission."""

    name = "none"
    uses_draft = False  # False: the gateway never calls the draft service

    def decide(self, view: SchedulerView) -> Decision:
        """Accept the scheduler's FIFO proposal; shapes from `shapes`, per replica."""
        p = view.proposal
        shapes: dict[str, Shape] = {}
        if self.uses_draft and view.draft.usable:
            for batch in view.batches(p.prefill_tokens):
                if batch.requests:
                    shapes.update(self.shapes(batch, view.replicas[batch.replica].cost))
        return Decision(admit=p.admit, defer=p.defer, chunks=None, shapes=shapes, residency=Residency.KEEP)

    def shapes(self, batch: BatchView, model: PassCost) -> dict[str, Shape]:
        """The speculation shape of every decoding request of one replica (d = 0: no draft tokens)."""
        return {r.rid: NO_DRAFT for r in batch.requests}

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        return {rid: [0] for rid in candidates}

    def filler(self, rid: str) -> int:
        """Nodes of `rid`'s last selection that the policy added only from its pass's slack (never making a
        request that keeps its pace late): SLO admission leaves them out of a tier's cost, since more
        decoders leave less slack and so fewer of them (none here)."""
        return 0

    def observe(self, record: IterationRecord) -> None:
        """Called after every iteration that ran a target pass."""

    def spec_prior(self, acceptance: float) -> tuple[float, float]:
        """(tree nodes, tokens) per pass this policy can give a request whose TPOT needs speculation, at
        the per-token acceptance rate measured now: SLO admission's prior for such a tier until it has
        measured more. A policy that drafts can give at least a one-token chain (root and one draft
        node); one that never drafts, (1, 1)."""
        return (2.0, expected_tokens(acceptance, 1)) if self.uses_draft else (1.0, 1.0)

    def describe(self) -> dict:
        return {"name": self.name}


__all__ = ["BatchView", "CandidateTree", "Policy", "RequestView", "Selected", "Shape", "Trees"]
