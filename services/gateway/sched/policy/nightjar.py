"""Nightjar: a batch-size-contextual bandit over a few (d, w) arms, and draft offload under KV pressure.

The bandit (the Nightjar digest's corrected §3 pseudocode; "errata N" below names the correction):

- context: the replica's decode batch size, in power-of-two buckets; arms: (d, w) shapes given to
  every request of the pass, (0, 1) = no draft call;
- schedule per bucket: blocks of H = 2^(j-1) rounds in sqrt(H) bins; a bin explores (an arm drawn
  uniformly) with probability 1/sqrt(bin), and exploration is capped at `explore_cap` of the
  bucket's rounds (digest pitfalls); otherwise every arm is pulled once, then the arm of the least
  cost 1/g (ms per token) is taken, plus a switching cost for arms that draft while the draft lags:
  c / (S_AMORT g t), c the catch-up of the lagging tokens at the measured catch-up rate;
- the reward: tokens the replica's requests got, per ms of the iteration timed at the gateway
  (`IterationRecord.total_ms`: every round trip and the gateway's own time), less the draft's
  catch-up (priced by the switching cost instead, errata 7) and less the co-scheduled prefill
  (the profiled target curve's share of it, so arms are not confounded with arrival bursts); the
  estimate is a running mean for 20 pulls, then an EMA of 0.05 (non-stationarity).

Elastic memory, through the draft service's Offload/Reload (`Decision.residency`), with hysteresis
and a dwell time:

- offload when, for `persist` consecutive iterations, the target's unreserved KV fraction is below
  `offload_free` and either requests wait for admission or every arm of the last `persist`
  iterations was (0, 1), and the draft has been resident for `dwell_s`;
- reload when nobody waits, the unreserved fraction is above `reload_free` (> `offload_free`) and
  the draft has been offloaded for `dwell_s`.

Time is the sum of the iterations' `total_ms` seen in `observe` (the policy reads no clock).
Cold requests: the draft's KV pool is freed by an offload, so a request that decoded while the
draft was not resident has lost its draft state or never had it; it stays non-speculative until it
finishes (the digest's default). Requests that start decoding after the reload speculate as usual.

On specserve the draft runs in its own process: an offload frees draft memory, not target KV
blocks (the digest's "draft on its own device" case), so the offload here buys nothing for the
target's pool; it is built as the paper specifies and measured as such.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import NO_DRAFT, Residency, SchedulerView, Shape
from specserve.gateway.sched.policy.base import BatchView, Decision, Policy, Selected, Trees
from specserve.shared.process.settings import Settings, option

DEFAULT_ARMS = [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2)]  # (d, w); at most about 8 (digest §8)
L_SYNC = 2  # draft lag (tokens) below which switching is free
MEAN_PULLS = 20  # running mean for this many pulls, then an EMA
EMA = 0.05


@dataclass(slots=True, kw_only=True)
class NightjarOptions(Settings):
    """Nightjar's elastic-memory triggers and exploration."""

    env_prefix: ClassVar[str] = "SPECSERVE_GATEWAY_"

    nightjar_offload_free: float = option(0.10, "nightjar: offload the draft below this unreserved KV fraction")
    nightjar_reload_free: float = option(0.30, "nightjar: reload it above this unreserved KV fraction, nobody waiting")
    nightjar_persist: int = option(16, "nightjar: iterations the offload condition must hold")
    nightjar_dwell_s: float = option(30.0, "nightjar: least time between an offload and a reload (either way), s")
    nightjar_explore_cap: float = option(0.05, "nightjar: most share of a bucket's rounds spent exploring")
    nightjar_seed: int = option(0, "nightjar: seed of the exploration draws")


@dataclass(slots=True)
class Arm:
    pulls: int = 0
    goodput: float = 0.0  # tokens per ms
    step_ms: float = 0.0

    def update(self, goodput: float, step_ms: float) -> None:
        self.pulls += 1
        w = 1.0 / self.pulls if self.pulls <= MEAN_PULLS else EMA
        self.goodput += w * (goodput - self.goodput)
        self.step_ms += w * (step_ms - self.step_ms)


@dataclass(slots=True)
class Bucket:
    """One batch-size bucket's schedule (block j of H rounds, bins of sqrt(H) rounds) and arms."""

    arms: list[Arm]
    j: int = 1
    h: int = 1
    bin: int = 1
    tau: int = 1
    explore: bool = False
    rounds: int = 0
    explored: int = 0

    def tick(self) -> None:
        self.rounds += 1
        self.tau += 1
        if self.tau > math.isqrt(self.h):
            self.bin += 1
            self.tau = 1
            if self.bin > math.isqrt(self.h):
                self.j += 1
                self.h = 2 ** (self.j - 1)
                self.bin = 1

    def rounds_left_in_bin(self) -> int:
        return max(0, math.isqrt(self.h) - self.tau + 1)


class Bandit:
    """The contextual bandit alone (no I/O): `choose` an arm index for a batch size, `update` its reward."""

    def __init__(self, arms: list[tuple[int, int]], explore_cap: float = 0.05, seed: int = 0, s_amort: int = 8):
        self.arms = arms
        self.explore_cap = explore_cap
        self.rng = random.Random(seed)
        self.s_amort = s_amort
        self.buckets: dict[int, Bucket] = {}

    @staticmethod
    def bucket_of(batch: int) -> int:
        return 1 << max(0, batch - 1).bit_length()  # 1, 2, 4, 8, ...

    def bucket(self, batch: int) -> Bucket:
        key = self.bucket_of(batch)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = Bucket([Arm() for _ in self.arms])
        return b

    def cost(self, b: Bucket, i: int, switch_ms: float) -> float:
        """ms per token of arm i, plus the switching cost amortised over S_AMORT rounds (errata 2)."""
        arm = b.arms[i]
        c = 1.0 / max(arm.goodput, 1e-9)
        if self.arms[i][0] > 0 and switch_ms > 0:
            s = max(self.s_amort, b.rounds_left_in_bin())
            c += switch_ms / (s * max(arm.goodput, 1e-9) * max(arm.step_ms, 1e-9))
        return c

    def choose(self, batch: int, allowed: list[int], switch_ms: float = 0.0) -> int:
        b = self.bucket(batch)
        if b.tau == 1:
            b.explore = self.rng.random() < 1.0 / math.sqrt(b.bin)
        untried = [i for i in allowed if b.arms[i].pulls == 0]
        if untried:
            return min(untried)  # pull every arm once (errata 1)
        if b.explore and b.explored < self.explore_cap * (b.rounds + 1):
            b.explored += 1
            return self.rng.choice(allowed)
        return min(allowed, key=lambda i: (self.cost(b, i, switch_ms), i))

    def update(self, batch: int, i: int, goodput: float, step_ms: float) -> None:
        b = self.bucket(batch)
        b.arms[i].update(goodput, step_ms)
        b.tick()


@dataclass(slots=True)
class Residence:
    """The offload/reload state machine: hysteresis on the unreserved KV fraction, a dwell time."""

    offload_free: float = 0.10
    reload_free: float = 0.30
    persist: int = 16
    dwell_ms: float = 30_000.0
    offloaded: bool = False
    low: int = 0  # consecutive iterations with the offload condition
    since_ms: float = math.inf  # time since the last transition (inf: none yet)
    recent_arms: deque[int] = field(default_factory=deque)  # depth of the last `persist` arms

    def __post_init__(self) -> None:
        if not 0 <= self.offload_free <= self.reload_free <= 1:
            raise ValueError(f"need 0 <= offload_free <= reload_free <= 1, got {self.offload_free}, "
                             f"{self.reload_free}")
        self.recent_arms = deque(maxlen=max(1, self.persist))

    def step(self, free_fraction: float, waiting: int, draft_offloaded: bool) -> Residency:
        """The residency for the next iteration."""
        self.offloaded = draft_offloaded
        dwelt = self.since_ms >= self.dwell_ms
        if not self.offloaded:
            off = len(self.recent_arms) == self.recent_arms.maxlen and not any(self.recent_arms)
            pressed = free_fraction < self.offload_free and (waiting > 0 or off)
            self.low = self.low + 1 if pressed else 0
            if self.low >= self.persist and dwelt:
                self.low, self.since_ms = 0, 0.0
                return Residency.OFFLOAD
            return Residency.KEEP
        self.low = 0
        if waiting == 0 and free_fraction > self.reload_free and dwelt:
            self.since_ms = 0.0
            return Residency.RELOAD
        return Residency.KEEP

    def chose(self, depth: int) -> None:
        self.recent_arms.append(depth)

    def elapse(self, ms: float) -> None:
        self.since_ms += ms


class Nightjar(Policy):
    name = "nightjar"
    uses_draft = True

    def __init__(self, arms: list[tuple[int, int]] | None = None, options: NightjarOptions | None = None):
        o = options or NightjarOptions()
        self.bandit = Bandit(arms or DEFAULT_ARMS, o.nightjar_explore_cap, o.nightjar_seed)
        self.residence = Residence(o.nightjar_offload_free, o.nightjar_reload_free, o.nightjar_persist,
                                   o.nightjar_dwell_s * 1e3)
        self.cold: set[str] = set()  # requests that decoded while the draft was not resident
        self.pulled: dict[int, tuple[int, int, int]] = {}  # replica -> (arm, batch size, lag) this iteration
        self.catchup_ms_per_token = -1.0  # EMA of the draft's catch-up cost (-1: not seen)
        self.prefill_share: dict[int, float] = {}  # replica -> predicted prefill ms in this iteration's pass
        self.stepping_replicas = 1  # replicas whose loops iterate side by side (their records each advance time)

    def decide(self, view: SchedulerView) -> Decision:
        live = view.live_rids
        self.cold = {rid for rid in self.cold if rid in live}
        up = [r for r in view.replicas if r.up]
        self.stepping_replicas = max(1, len(up)) if view.replica is not None else 1
        total = sum(r.total_blocks for r in up)
        free = sum(r.free_blocks for r in up) / total if total else 1.0
        residency = self.residence.step(free, len(view.waiting), view.draft.offloaded)
        if residency is not Residency.KEEP or not view.draft.usable:
            # the draft's KV pool is (being) freed: these stay non-speculative (another replica's
            # decoding requests are marked by its own iterations' plans)
            self.cold |= {r.rid for r in view.decoding}
        stepping = [rep.index for rep in view.replicas if view.stepping(rep.index)]
        for i in stepping:  # the replicas this plan shapes start afresh (the others are mid-iteration)
            self.pulled.pop(i, None)
            self.prefill_share.pop(i, None)
        decision = super().decide(view)
        if residency is Residency.OFFLOAD:  # nobody speculates in an iteration that offloads: no arm was pulled
            decision.shapes = {}
            for i in stepping:
                self.pulled.pop(i, None)
        if not any(i in self.pulled for i in stepping):
            self.residence.chose(0)
        decision.residency = residency
        return decision

    def shapes(self, batch: BatchView, model: PassCost) -> dict[str, Shape]:
        n = len(batch.requests)
        warm = [r for r in batch.requests if r.rid not in self.cold and r.remaining > 1]
        if not warm:
            return {r.rid: NO_DRAFT for r in batch.requests}
        lag = sum(r.draft_lag for r in warm)
        switch = self.catchup_ms_per_token * lag if lag > L_SYNC * len(warm) and self.catchup_ms_per_token > 0 else 0.0
        i = self.bandit.choose(n, list(range(len(self.bandit.arms))), switch)
        d, w = self.bandit.arms[i]
        self.pulled[batch.replica] = (i, n, lag if d > 0 else 0)
        self.residence.chose(d)
        if batch.prefill_tokens:
            nodes = n * (1 + d * w)
            self.prefill_share[batch.replica] = max(0.0, model.target_ms(nodes + batch.prefill_tokens)
                                                    - model.target_ms(nodes))
        chosen = {r.rid for r in warm}
        return {r.rid: Shape(min(d, r.remaining - 1), w) if r.rid in chosen and d > 0 else NO_DRAFT
                for r in batch.requests}

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        return {rid: list(range(len(tree.tokens))) for rid, tree in candidates.items()}

    def observe(self, record: IterationRecord) -> None:
        # each replica's loop records its own iterations, side by side: the wall time that passed is
        # about one replica's iteration, so the dwell clock advances by the share of this one
        self.residence.elapse(record.total_ms / self.stepping_replicas)
        pulled = {s.replica: self.pulled.pop(s.replica) for s in record.replicas if s.replica in self.pulled}
        lag_sent = sum(lag for _, _, lag in pulled.values())
        if record.draft.requests and lag_sent > 0 and record.draft.failure is None:
            rate = record.draft.catchup_ms / lag_sent
            a = 0.2
            self.catchup_ms_per_token = rate if self.catchup_ms_per_token < 0 else \
                self.catchup_ms_per_token + a * (rate - self.catchup_ms_per_token)
        for replica, (i, n, _) in pulled.items():
            tokens = sum(s.emitted for s in record.requests if s.replica == replica and s.verified > 0)
            ms = record.total_ms - record.draft.catchup_ms - self.prefill_share.get(replica, 0.0)
            if tokens > 0 and ms > 0:
                self.bandit.update(n, i, tokens / ms, ms)

    def describe(self) -> dict:
        r = self.residence
        return {"name": self.name, "arms": [list(a) for a in self.bandit.arms], "offload_free": r.offload_free,
                "reload_free": r.reload_free, "persist": r.persist, "dwell_s": r.dwell_ms / 1e3,
                "explore_cap": self.bandit.explore_cap}


def parse_arms(arg: str) -> list[tuple[int, int]] | None:
    """`2x1,4x2` -> [(2, 1), (4, 2)]; empty -> the default arms."""
    if not arg:
        return None
    arms = []
    for part in arg.split(","):
        d, _, w = part.partition("x")
        arm = (int(d), int(w or 1))
        if arm[0] < 0 or arm[1] < 1:
            raise ValueError(f"an arm is DxW with D >= 0 and W >= 1, got {part!r}")
        arms.append(arm)
    return arms


__all__ = ["Bandit", "DEFAULT_ARMS", "Nightjar", "NightjarOptions", "Residence", "parse_arms"]
