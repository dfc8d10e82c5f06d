"""TurboSpec: each iteration, the chain length k that maximises predicted goodput, 0 (no draft call) included.

The controller (`GoodputControl`, shared with `slo-goodput`) per replica:

- predicts goodput G(k) = sum_i l(a_i, k_i) / T(k) for k in 0..K_max from the goodput model
  (goodput.py: the MLE acceptance rate per request; cost.py: the replica's iteration time), and changes k
  only when the best predicts a gain above `margin` over the current one (digest pitfalls);
- skips the draft "prefill" under load: a request that starts decoding while more requests run
  than the smallest batch at which k = 0 was chosen (`thr`) never speculates, so the draft never
  receives its prompt (digest §3, errata 4). `thr` resets after `skip_reset` skips; when the best
  k is positive again and the batch is below `thr`, skipped requests whose draft lag is at most
  `late_lag` tokens are enabled late (their catch-up is priced in the draft time);
- holds a clear "off": when k = 0 was chosen with every k > 0 predicting less than `HOLD_SHARE` of k = 0's
  goodput, the next `HOLD_STEPS` iterations of that replica keep k = 0 without pricing the depths again,
  unless its batch shrinks below `HOLD_BATCH` of the size priced or a drafted step (a probe) is observed;
  a far-off verdict cannot turn within a few steps otherwise (the inputs move by a request or a token a step);
- probes after long off periods: after `probe_every` iterations at k = 0 (`FAR_PROBES` times as many while
  the off is held: far from paying, a probe's measurement is unlikely to turn it), one request (the least
  draft lag, in turn among equals) speculates for one iteration with k = 1, 2, 4 in turn
  (PROBE_DEPTHS), so that the acceptance estimate, the draft's per-step cost and the target's cost
  of a few more tokens are measured at more than one depth; and the other way, after `probe_every` iterations at
  k > 0, one iteration runs without a draft call so the plain pass stays measured (on a CPU the
  1-token-per-request pass is much cheaper than the profiled line says).

Nothing here does I/O: time comes from the IterationRecords given to `observe`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import NO_DRAFT, SchedulerView
from specserve.gateway.sched.policy.base import BatchView, Decision, Policy, RequestView, Selected, Shape, Trees
from specserve.gateway.sched.policy.goodput import Acceptance, best_depth, expected_tokens

PROBE_DEPTHS = (1, 2, 4)  # a probe's chain, in turn
HOLD_SHARE = 0.5  # an "off" is held when the best k > 0 predicts less than this share of k = 0's goodput
HOLD_STEPS = 8  # iterations it is held without pricing
HOLD_BATCH = 0.75  # a batch below this share of the size priced prices again
FAR_PROBES = 4  # while an off is held, probes come this many times less often


@dataclass(slots=True)
class GoodputControl:
    max_k: int = 7  # K_max
    margin: float = 0.03  # relative predicted gain needed to change k
    probe_every: int = 50  # iterations at k = 0 before a probe
    skip_reset: int = 32  # skipped draft prefills before the threshold resets
    late_lag: int = 256  # most draft lag (tokens) of a skipped request enabled late
    acceptance: Acceptance = field(default_factory=Acceptance)
    current: dict[int, int] = field(default_factory=dict)  # per replica: the k in force
    off_steps: dict[int, int] = field(default_factory=dict)  # per replica: iterations at k = 0 since a probe
    on_steps: dict[int, int] = field(default_factory=dict)  # per replica: iterations at k > 0 since a pause
    probe_turn: int = 0
    thr: float = math.inf  # draft-prefill skip threshold (running requests)
    skips: int = 0
    draft_ok: dict[str, bool] = field(default_factory=dict)  # rid -> may it speculate
    proposed: dict[str, int] = field(default_factory=dict)  # rid -> draft tokens verified (chain depth)
    held: dict[int, tuple[int, int]] = field(default_factory=dict)  # per replica: (batch priced, steps left) of an off

    def holds(self, batch: BatchView) -> bool:
        """Whether this replica's iteration keeps k = 0 unpriced (a held off: module docstring); counts the step."""
        held = self.held.get(batch.replica)
        if held is None or self.current.get(batch.replica, 0) != 0:
            return False
        priced, left = held
        if left <= 0 or len(batch.requests) < HOLD_BATCH * priced:
            del self.held[batch.replica]
            return False
        self.held[batch.replica] = (priced, left - 1)
        return True

    def hold(self, batch: BatchView, k: int, plain: dict[int, float]) -> None:
        """After pricing: hold k = 0 where it was chosen far off (every k > 0 under `HOLD_SHARE` of k = 0's plain
        goodput), else drop any hold."""
        if k == 0 and len(plain) > 1 and max(g for d, g in plain.items() if d > 0) < HOLD_SHARE * plain[0]:
            self.held[batch.replica] = (len(batch.requests), HOLD_STEPS)
        else:
            self.held.pop(batch.replica, None)

    # ---- per iteration -----------------------------------------------------------------------------
    def admit(self, view: SchedulerView, keep: Callable[[RequestView], bool] | None = None) -> None:
        """New decoding requests: skip their draft prefill under load, except those `keep` names; forget
        finished ones."""
        live = view.live_rids
        mine = [r for r in view.decoding if view.stepping(r.replica)]
        running = len(mine)  # on the replica this plan steps (thr is a replica's batch size)
        for r in mine:
            if r.rid not in self.draft_ok:
                ok = running <= self.thr or (keep is not None and keep(r))
                self.draft_ok[r.rid] = ok
                if not ok:
                    self.skips += 1
                    if self.skips % self.skip_reset == 0:
                        self.thr = math.inf  # periodic re-enable
        for rid in [rid for rid in self.draft_ok if rid not in live]:
            del self.draft_ok[rid]
        self.acceptance.forget(live)

    def step_ms(self, batch: BatchView, cost: PassCost, spec: list[RequestView],
                k: int) -> tuple[list[int], float]:
        """The chain each request of `spec` drafts (k, or fewer where its output ends sooner) and the
        predicted time of this replica's iteration with them, ms."""
        ks = [min(k, r.remaining - 1) for r in spec]
        lag = sum(r.draft_lag for r, kr in zip(spec, ks, strict=True) if kr > 0)
        t = cost.iteration_ms(len(batch.requests) + sum(ks) + batch.prefill_tokens, max(ks, default=0),
                              sum(1 for kr in ks if kr > 0), 1, lag, batch.kv_blocks)
        return ks, t

    def tokens_ms(self, batch: BatchView, cost: PassCost, spec: list[RequestView], k: int,
                  rates: dict[str, float] | None = None) -> tuple[float, float]:
        """(predicted tokens, ms) of this replica's pass if the requests in `spec` draft k-token chains
        (rates: `Acceptance.rates` of them, when the caller prices several k)."""
        ks, t = self.step_ms(batch, cost, spec, k)
        rates = rates or self.acceptance.rates(spec)
        tokens = sum(expected_tokens(rates[r.rid], kr) for r, kr in zip(spec, ks, strict=True))
        return tokens + len(batch.requests) - len(spec), t

    def depth_table(self, batch: BatchView, cost: PassCost, spec: list[RequestView],
                    rates: dict[str, float] | None = None) -> list[tuple[float, float]]:
        """`tokens_ms` for every k in 0..max_k, from one pass over `spec`: its requests counted by (rate, the longest
        chain their output allows), each k priced per group rather than per request, the target's curve once."""
        rates = rates or self.acceptance.rates(spec)
        groups: dict[tuple[float, int], int] = {}
        lag = drafts = 0  # of the requests whose chain is not empty at k > 0
        for r in spec:
            longest = min(r.remaining - 1, self.max_k)
            if longest > 0:
                lag += r.draft_lag
                drafts += 1
            key = (rates[r.rid], longest)
            groups[key] = groups.get(key, 0) + 1
        n, plain = len(batch.requests), len(batch.requests) - len(spec)
        tokens: list[float] = []
        rows: list[tuple[int, int, int, int]] = []
        for k in range(self.max_k + 1):
            chains = [(a, min(k, longest), count) for (a, longest), count in groups.items()]
            tokens.append(sum(count * expected_tokens(a, kr) for a, kr, count in chains) + plain)
            rows.append((n + sum(count * kr for _, kr, count in chains) + batch.prefill_tokens,
                         max((kr for _, kr, _ in chains), default=0), drafts if k > 0 else 0, lag if k > 0 else 0))
        return list(zip(tokens, cost.iteration_table(rows, 1, batch.kv_blocks), strict=True))

    def goodput(self, batch: BatchView, cost: PassCost, spec: list[RequestView], k: int,
                rates: dict[str, float] | None = None) -> float:
        """Predicted tokens per ms of this replica's pass if the requests in `spec` draft k-token chains."""
        tokens, t = self.tokens_ms(batch, cost, spec, k, rates)
        return tokens / t

    def eligible(self, batch: BatchView) -> tuple[list[RequestView], list[RequestView]]:
        """(the requests that may draft, the skipped ones that may start late: load dropped below the
        skip threshold and their catch-up is short; it is priced in the draft time)."""
        ready = [r for r in batch.requests if self.draft_ok.get(r.rid, True)]
        late = [r for r in batch.requests if not self.draft_ok.get(r.rid, True) and r.draft_lag <= self.late_lag] \
            if len(batch.requests) < self.thr else []
        return ready, late

    def settle(self, batch: BatchView, k: int, late: list[RequestView], spec: list[RequestView]) -> None:
        """Record this replica's choice: the late requests among the drafting ones are enabled (k > 0);
        k = 0 while some request of `spec` could draft sets the draft-prefill skip threshold to n."""
        if k > 0:
            for r in late:
                self.draft_ok[r.rid] = True
        elif any(r.remaining > 1 for r in spec):  # drafting could run and does not pay at n
            self.thr = min(self.thr, len(batch.requests))
        self.current[batch.replica] = k

    def choose(self, batch: BatchView, cost: PassCost) -> tuple[int, list[RequestView]]:
        """(k for this replica, the requests that may speculate)."""
        spec, late = self.eligible(batch)
        if self.holds(batch):
            self.settle(batch, 0, late, spec)
            return 0, spec
        rates = self.acceptance.rates(spec + late)
        table = {k: tokens / t for k, (tokens, t) in enumerate(self.depth_table(batch, cost, spec + late, rates))} \
            if spec or late else {0: 0.0}
        k = best_depth(table, self.current.get(batch.replica, 0), self.margin)
        self.hold(batch, k, table)
        if k > 0 and late:
            spec = spec + late
        self.settle(batch, k, late, spec)
        return k, spec

    def probe(self, batch: BatchView, spec: list[RequestView], k: int) -> tuple[str, int] | None:
        """After `probe_every` iterations at k = 0 (`FAR_PROBES` times as many while the replica's off is held),
        one request (in turn) speculates for one iteration: its rid and chain (PROBE_DEPTHS in turn, within its
        remaining tokens)."""
        off = self.off_steps.get(batch.replica, 0) + 1 if k == 0 else 0
        self.off_steps[batch.replica] = off
        if off < self.probe_every * (FAR_PROBES if batch.replica in self.held else 1):
            return None
        candidates = [r for r in spec if r.remaining > 1]
        if not candidates:
            return None
        self.off_steps[batch.replica] = 0
        self.probe_turn += 1
        least = min(r.draft_lag for r in candidates)  # the cheapest catch-up; in turn among equals
        cheapest = [r for r in candidates if r.draft_lag == least]
        r = cheapest[self.probe_turn % len(cheapest)]
        return r.rid, min(PROBE_DEPTHS[(self.probe_turn - 1) % len(PROBE_DEPTHS)], r.remaining - 1)

    def pause(self, batch: BatchView, k: int) -> bool:
        """After `probe_every` iterations at k > 0, one iteration without a draft call, so the plain
        pass's time stays measured at the running batch (the other side of the probe)."""
        if k <= 0:
            self.on_steps[batch.replica] = 0
            return False
        on = self.on_steps.get(batch.replica, 0) + 1
        self.on_steps[batch.replica] = 0 if on >= self.probe_every else on
        return on >= self.probe_every

    def selected(self, candidates: Trees, selected: Selected) -> None:
        """Remember each request's verified draft depth: the acceptance MLE's `proposed`."""
        for rid, nodes in selected.items():
            tree = candidates[rid]
            self.proposed[rid] = max((tree.depths[v] for v in nodes), default=0)

    def observe(self, record: IterationRecord) -> None:
        for s in record.requests:
            k = self.proposed.pop(s.rid, 0)
            if k > 0 and s.error is None and s.verified > 0:
                self.acceptance.observe(s.rid, k, s.accepted)
                self.held.clear()  # a measured acceptance: price again


class TurboSpec(Policy):
    """TurboSpec on chains: one goodput-optimal k per replica pass, 0 included."""

    name = "turbospec"
    uses_draft = True

    def __init__(self, max_k: int = 7, margin: float = 0.03, probe_every: int = 50):
        self.control = GoodputControl(max_k=max_k, margin=margin, probe_every=probe_every)

    def decide(self, view: SchedulerView) -> Decision:
        self.control.admit(view, self.keeps_draft(view))
        return super().decide(view)

    def keeps_draft(self, view: SchedulerView) -> Callable[[RequestView], bool] | None:
        """The new decoding requests whose draft prefill is never skipped (TurboSpec: none)."""
        return None

    def choose(self, batch: BatchView, model: PassCost) -> tuple[int, list[RequestView]]:
        """(k for this replica's pass, the requests that draft k-token chains); `joint` overrides it."""
        return self.control.choose(batch, model)

    def shapes(self, batch: BatchView, model: PassCost) -> dict[str, Shape]:
        k, spec = self.choose(batch, model)
        probe = self.control.probe(batch, spec, k)
        if self.control.pause(batch, k):
            spec = []
        chosen = {r.rid for r in spec}
        shapes = {r.rid: Shape(min(k, r.remaining - 1), 1) if r.rid in chosen else NO_DRAFT
                  for r in batch.requests}
        if probe is not None:
            rid, depth = probe
            shapes[rid] = Shape(depth, 1)
        return shapes

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        selected = {rid: list(range(len(tree.tokens))) for rid, tree in candidates.items()}
        self.control.selected(candidates, selected)
        return selected

    def observe(self, record: IterationRecord) -> None:
        self.control.observe(record)

    def spec_prior(self, acceptance: float) -> tuple[float, float]:
        """The cheapest chain, one draft token, at the acceptance rate this controller estimates (the
        rate it prices its own choices with)."""
        return 2.0, expected_tokens(self.control.acceptance.rate, 1)

    def describe(self) -> dict:
        c = self.control
        return {"name": self.name, "max_k": c.max_k, "margin": c.margin, "probe_every": c.probe_every}


__all__ = ["GoodputControl", "TurboSpec"]
