"""IterationRecord: one record per engine iteration, the single source for metrics, the latency
models, `Policy.observe` and the iteration's trace span (spans.py).

It holds the iteration's composition (per request: its replica, prompt chunk, planned shape, tree
nodes verified, draft tokens accepted, tokens emitted; per replica: prompt tokens, tree nodes) and
its time, split four ways so that the parts add up to the whole:

- draft: inside the draft service (the Speculate call's `total_ms`, plus any wait for the eager
  draft sync beyond the target pass);
- target: inside the slowest target replica of the pass (its `total_ms`);
- transport: the rest of those calls (encoding, sockets, the reply's wait in the event loop);
- schedule: everything outside the calls (snapshot, plan, policy, selection, commit, streaming).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestStep:
    rid: str
    replica: int
    prompt_tokens: int = 0  # prompt tokens of this request in the pass (a prefill chunk)
    depth: int = 0  # planned beam depth d (0: no draft tokens)
    width: int = 1  # planned beam width w
    verified: int = 0  # tree nodes sent to the target, root included (0: a prefill chunk)
    filler: int = 0  # of those, nodes the policy added from its pass's slack (`Policy.filler`)
    accepted: int = 0  # accepted draft tokens
    emitted: int = 0  # tokens the target returned (accepted + 1, or the first token)
    error: str | None = None  # the entry's error code, if it failed


@dataclass(slots=True)
class ReplicaStep:
    replica: int
    prefill_tokens: int = 0  # prompt tokens in its pass
    tree_nodes: int = 0  # tree nodes in its pass, roots included
    call_ms: float = 0.0  # the Forward call as the gateway saw it
    service_ms: float = 0.0  # inside the target service (the reply's total_ms)
    forward_ms: float = 0.0  # the model pass alone (the reply's forward_ms)
    warmup: bool = False  # the pass captured a CUDA graph (the reply's warmup): the cost model skips it
    failure: str | None = None  # "remote: ..." (the service refused the call) or "down: ..." (transport)


@dataclass(slots=True)
class DraftStep:
    requests: int = 0  # entries with d > 0 in the Speculate call
    lag: int = 0  # committed tokens those entries carried for the draft to catch up
    call_ms: float = 0.0  # the Speculate call as the gateway saw it (on the critical path)
    service_ms: float = 0.0  # inside the draft service (the reply's total_ms)
    catchup_ms: float = 0.0  # appending committed tokens to the draft KV, inside the service
    beam_ms: float = 0.0  # the d beam steps, inside the service
    sync_requests: int = 0  # d = 0 entries sent only to keep the draft current (eager sync)
    ahead: int = 0  # entries drafting the next step's tree ahead (--overlap), in the same call
    ahead_hits: int = 0  # of those, requests whose answer matched the guess: their next tree is ready
    guessed: int = 0  # chains sent one step ahead on a guess of the answer in flight (--async-scheduling)
    guess_hits: int = 0  # of those, the ones whose guess the answer matched (verified as drafted)
    sync_call_ms: float = 0.0  # that call (sync and ahead entries), run beside the target pass
    sync_service_ms: float = 0.0
    transition: str | None = None  # "offload" or "reload" when the residency changed
    transition_ms: float = 0.0  # that call, as the gateway saw it
    warmup: bool = False  # a beam step captured a CUDA graph (the reply's warmup): the cost model skips the iteration
    failure: str | None = None

    @property
    def beside(self) -> int:
        """Entries of the draft call that ran beside the target pass."""
        return self.sync_requests + self.ahead


@dataclass(slots=True)
class IterationRecord:
    step: int
    requests: list[RequestStep] = field(default_factory=list)
    replicas: list[ReplicaStep] = field(default_factory=list)
    draft: DraftStep = field(default_factory=DraftStep)
    target_phase_ms: float = 0.0  # wall time of the target pass (all replicas, and the eager sync beside it)
    total_ms: float = 0.0  # the whole iteration
    admitted: int = 0
    deferred: int = 0
    rejected: int = 0
    waiting: int = 0  # requests still waiting after admission
    running: int = 0  # requests admitted after the iteration
    sent_ahead: bool = False  # its pass went before the replica's previous one was committed (--async-scheduling)

    # ---- composition ---------------------------------------------------------------------------
    @property
    def prefill_tokens(self) -> int:
        return sum(r.prefill_tokens for r in self.replicas)

    @property
    def tree_nodes(self) -> int:
        return sum(r.tree_nodes for r in self.replicas)

    @property
    def verify_steps(self) -> list[RequestStep]:
        return [r for r in self.requests if r.verified > 0 and r.error is None]

    # ---- the time split (ms; the four parts add up to total_ms) ------------------------------------
    @property
    def target_service_ms(self) -> float:
        return max((r.service_ms for r in self.replicas if r.failure is None), default=0.0)

    @property
    def pass_ms(self) -> float:
        """The target's model pass alone, the longest over replicas (within target_ms: not a fifth part)."""
        return max((r.forward_ms for r in self.replicas if r.failure is None), default=0.0)

    @property
    def target_call_ms(self) -> float:
        return max((r.call_ms for r in self.replicas), default=0.0)

    @property
    def draft_ms(self) -> float:
        """Inside the draft on the critical path: the Speculate call's service time, plus the wait for
        the eager sync after the target pass ended."""
        overhang = max(0.0, self.target_phase_ms - self.target_call_ms) if self.draft.beside else 0.0
        return self.draft.service_ms + overhang

    @property
    def target_ms(self) -> float:
        return self.target_service_ms

    @property
    def transport_ms(self) -> float:
        draft = max(0.0, self.draft.call_ms - self.draft.service_ms) + self.draft.transition_ms
        gather = 0.0 if self.draft.beside else max(0.0, self.target_phase_ms - self.target_call_ms)
        return draft + max(0.0, self.target_call_ms - self.target_service_ms) + gather

    @property
    def schedule_ms(self) -> float:
        calls = self.draft.call_ms + self.draft.transition_ms + self.target_phase_ms
        return max(0.0, self.total_ms - calls)
