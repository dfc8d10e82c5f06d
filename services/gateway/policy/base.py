"""The one interface every speculation policy plugs into.

Each gateway iteration asks the policy two things:

1. `plan(batch, model)`: the speculation shape (depth d, width w) of every decoding request, before
   the draft is called (d = 0: no draft tokens for it; if every d is 0 the draft is not called);
2. `select(batch, candidates, model)`: which nodes of each request's candidate tree the target
   verifies (node 0, the root, always; a selection is closed under parents).

After the target pass the engine reports what happened through `observe` (accepted lengths and
timings), so learning policies (TurboSpec's goodput model, Nightjar's bandit) can update. `admit`
orders the waiting queue, which is where SLOs-Serve's admission DP will plug in. Nothing here
knows about transport or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.gateway.latency import LatencyModel


@dataclass(slots=True)
class RequestView:
    """What a policy sees of one decoding request."""

    rid: str
    tier: str  # SLO class name
    tpot_ms: float  # TPOT SLO, ms per output token after the first
    ttft_ms: float  # TTFT SLO, ms
    decoded: int  # o_i: output tokens after the first
    decode_elapsed_ms: float  # l_i: ms since the first output token
    remaining: int  # output tokens still allowed (max_tokens and context); >= 1
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens of each past verify step

    def required(self, t_spec_ms: float) -> float:
        """AdaServe's A(r): tokens this step must yield to stay on the TPOT SLO in expectation."""
        return (self.decode_elapsed_ms + t_spec_ms) / self.tpot_ms - self.decoded


@dataclass(slots=True)
class BatchView:
    requests: list[RequestView]  # the decoding requests, in admission order
    prefill_tokens: int = 0  # prompt tokens co-scheduled in this iteration's target pass
    waiting: int = 0  # requests not yet admitted
    draft_available: bool = True  # False while the draft service is down (plan is then ignored)

    def tree_budget(self, model: LatencyModel) -> int:
        """The budget left for trees, roots included: B minus the co-scheduled prefill tokens,
        never below one root per request."""
        return max(len(self.requests), model.budget_tokens - self.prefill_tokens)


@dataclass(slots=True)
class Shape:
    depth: int  # beam steps d (0 = no draft tokens)
    width: int  # beam width w


@dataclass(slots=True)
class Plan:
    shapes: dict[str, Shape]  # per decoding request
    offload_draft: bool | None = None  # Nightjar: True moves the draft to host memory, False back; None keeps


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
        return cls([token], [-1], [1.0])

    def subtree(self, nodes: list[int]) -> tuple[list[int], list[int]]:
        """Tokens and re-indexed parents of a parent-closed node selection, in node order."""
        nodes = sorted(nodes)
        index = {v: i for i, v in enumerate(nodes)}
        return [self.tokens[v] for v in nodes], [index[self.parents[v]] if v else -1 for v in nodes]


Trees = dict[str, CandidateTree]  # candidate tree per request id
Selected = dict[str, list[int]]  # selected node indices per request id, sorted, root included


@dataclass(slots=True)
class Outcome:
    """One request's result of a verify step, reported back through `observe`."""

    rid: str
    verified: int  # tree nodes sent to the target, root included
    accepted: int  # accepted draft tokens


class Policy:
    """The base policy: no speculation (plain continuous batching)."""

    name = "none"
    uses_draft = False  # False: the gateway never calls the draft service

    def plan(self, batch: BatchView, model: LatencyModel) -> Plan:
        return Plan({r.rid: Shape(0, 1) for r in batch.requests})

    def select(self, batch: BatchView, candidates: Trees, model: LatencyModel) -> Selected:
        return {rid: [0] for rid in candidates}

    def observe(self, batch: BatchView, outcomes: list[Outcome], iteration_ms: float) -> None:
        """Called after every iteration with decoding requests."""

    def admit(self, waiting: list[str], batch: BatchView, model: LatencyModel) -> list[str]:
        """The waiting requests in the order to try admitting them (FIFO by default)."""
        return waiting

    def describe(self) -> dict:
        return {"name": self.name}
