"""`joint`: each iteration, who drafts and how deep, chosen together from SLO state and predicted goodput.

Per replica and iteration, from the seeds' models (goodput.py: the per-request
acceptance MLE and the three-service step-time model, refitted online):

1. Every decoding request has a *pace*: the ms per token it may take from now on and still meet
   its TPOT SLO, (tpot * (decoded + remaining) - elapsed) / remaining. At the predicted iteration
   time t it is
   - *lost* when not even a chain of K_max accepted whole every step could keep that pace: it
     never drafts (its root still runs). Only this best case condemns a request, never the
     estimated acceptance rate (why: docs/lab/sweep_default.md, "The default: `joint`");
   - *at risk* when its root alone cannot keep its pace (t > pace);
   - *slack* otherwise.
2. Two options: the wide one, every request not lost drafting chains of TurboSpec's
   goodput-optimal length k in 0..K_max (tokens per ms of the whole pass, with its hysteresis; less
   what the longer pass costs the requests whose first token waits on it, and never a pass so long
   that a prompt being prefilled may miss (at the planner's margin) the TTFT it would meet otherwise:
   `wide`); the narrow one, the at-risk requests alone drafting chains of the k of the best predicted *SLO
   goodput*: the expected tokens of the requests that keep their pace at the option's step time T
   (a chain of k yields l(a, k) tokens per T; a request that falls behind its pace counts nothing),
   over T. The narrow option wins only when its SLO goodput beats the wide one's. So under load,
   when drafting for everyone would make the pass too long for the requests at risk, the requests
   with slack keep their roots only and the tokens go to those at risk; when every request keeps
   its pace this is TurboSpec on the requests not lost.
3. k = 0 is the off switch (no draft call), with TurboSpec's draft-prefill skip, probes and held offs
   (the skip only where drafting does not pay at the batch size, not while the prices of step 2 hold it
   off; an off is held unpriced only while no request is at risk); a request that starts decoding at risk
   keeps its draft prefill whatever the load; every drafted chain is verified whole.
4. Trees where they pay (branching.py): when no request waits for admission, none of a batch of
   several is at risk and every request of the batch that is not lost keeps its pace with its chain,
   the drafting requests ask for trees instead of chains if the draft's extra time for the width is
   worth the side tokens measured, and beside each chain the target verifies the side nodes whose
   estimated acceptance beats the pass's goodput per ms of verification without making a request that
   keeps its pace late. Under SLO pressure the budget goes to chains (measured:
   docs/lab/sweep_default.md, "Side branches").
"""

from __future__ import annotations

import math
from collections.abc import Callable

from specserve.gateway.perf.cost import PassCost
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import SchedulerView, last_pass_end_ms
from specserve.gateway.sched.policy.base import BatchView, RequestView, Selected, Shape, Trees
from specserve.gateway.sched.policy.branching import Branches
from specserve.gateway.sched.policy.goodput import best_depth, expected_tokens
from specserve.gateway.sched.policy.turbospec import TurboSpec

LOST, AT_RISK, SLACK = "lost", "at_risk", "slack"


def makes_late(batch: BatchView, t0: float, t: float, slow: float = 0.0) -> bool:
    """Whether passes of t ms instead of t0, kept until the replica's prompts are in, may make a prefilling
    request miss its TTFT SLO that passes of t0 would meet: its prompt and those whose deadline comes
    first (`BatchView.prompts`' order) go in at this pass's prompt tokens a pass, its first token comes
    with its last chunk's pass, which must end by the deadline less its reserve (`last_pass_end_ms`); the longer
    passes are priced with the planner's margin (`slow`: the share by which slow prompt passes overran their
    price, `PassCost.slow_share`)."""
    if batch.prefill_tokens <= 0 or t <= t0:
        return False
    ahead = 0
    for tokens, left_ms in batch.prompts:
        ahead += tokens
        passes = math.ceil(ahead / batch.prefill_tokens)
        kept = last_pass_end_ms(left_ms)
        if passes * t0 <= kept < passes * t * (1.0 + slow):
            return True
    return False


class Joint(TurboSpec):
    name = "joint"

    def __init__(self, max_k: int = 7, margin: float = 0.03, probe_every: int = 50, tree_width: int = 4):
        super().__init__(max_k, margin, probe_every)
        self.branches = Branches(width=tree_width, probe_every=probe_every)

    def state(self, r: RequestView, t_ms: float, pace: float | None = None) -> str:
        """LOST, AT_RISK or SLACK for a decoding request at a predicted iteration time of `t_ms` (pace: its
        `pace_ms()`, when the caller has it)."""
        pace = r.pace_ms() if pace is None else pace
        if pace * (self.control.max_k + 1) < t_ms:
            return LOST
        return AT_RISK if pace < t_ms else SLACK

    def value(self, batch: BatchView, model: PassCost, group: list[RequestView], k: int,
              rates: dict[str, float] | None = None, paces: dict[str, float] | None = None,
              t: float | None = None) -> float:
        """Predicted SLO goodput (tokens per ms) of this pass if the requests in `group` draft k-token chains
        (rates, paces: `Acceptance.rates` and `pace_ms()` of the batch's requests, when the caller prices
        several k; t: the pass's time, `GoodputControl.step_ms`, when the caller has it)."""
        c = self.control
        chains = {r.rid: min(k, r.remaining - 1) for r in group}
        t = c.step_ms(batch, model, group, k)[1] if t is None else t
        rates = rates or c.acceptance.rates(batch.requests)
        paces = paces or {r.rid: r.pace_ms() for r in batch.requests}
        good = 0.0
        for r in batch.requests:
            tokens = expected_tokens(rates[r.rid], chains.get(r.rid, 0))
            if t <= paces[r.rid] * tokens:
                good += tokens
        return good / t

    def wide(self, batch: BatchView, model: PassCost, may: list[RequestView],
             rates: dict[str, float]) -> tuple[dict[int, float], dict[int, float]]:
        """Per k, the wide option's goodput, priced and plain. Plain: TurboSpec's tokens per ms of the pass
        when `may` draft k-token chains. Priced: less what the longer pass costs the requests whose first
        token waits on it (waiting for admission, or prefilling on this replica): each starts that much
        later, and once decoding makes a token a pass, so a pass longer by dt than the one without drafts
        costs each of them dt / t0 tokens; and a k whose pass may make a prefilling request miss its TTFT
        at the planner's margin (`makes_late`) is not an option."""
        c = self.control
        behind = batch.waiting + batch.prefilling
        priced: dict[int, float] = {}
        plain: dict[int, float] = {}
        t0, slow = 0.0, model.slow_share()
        for k, (tokens, t) in enumerate(c.depth_table(batch, model, may, rates)):
            t0 = t if k == 0 else t0
            plain[k] = tokens / t
            late = k > 0 and makes_late(batch, t0, t, slow)
            priced[k] = -math.inf if late else (tokens - behind * (t - t0) / max(t0, 1e-9)) / t
        return priced, plain

    def choose(self, batch: BatchView, model: PassCost) -> tuple[int, list[RequestView]]:
        """(k, the requests that draft k-token chains): the wider option unless the narrow one's
        predicted SLO goodput is higher."""
        c = self.control
        t = model.t_spec_ms
        ready, late = c.eligible(batch)
        allowed = {r.rid for r in ready + late}
        paces: dict[str, float] = {}  # once, as the rates: every k is priced with them
        may: list[RequestView] = []
        narrow: list[RequestView] = []  # the at-risk ones among `may`
        for r in batch.requests:
            pace = paces[r.rid] = r.pace_ms()
            state = self.state(r, t, pace)
            if r.rid in allowed and r.remaining > 1 and state != LOST:
                may.append(r)
                if state == AT_RISK:
                    narrow.append(r)
        if not narrow and c.holds(batch):  # a far-off k = 0 held, and nobody at risk
            c.settle(batch, 0, [], may)
            return 0, may
        current = c.current.get(batch.replica, 0)
        rates = c.acceptance.rates(batch.requests) if may else {}
        wide, plain = self.wide(batch, model, may, rates) if may else ({0: 0.0}, {0: 0.0})
        k, spec = best_depth(wide, current, c.margin), may
        if narrow and len(narrow) < len(may):
            times = [t for _, t in c.depth_table(batch, model, narrow, rates)]
            table = {k: self.value(batch, model, narrow, k, rates, paces, t) for k, t in enumerate(times)}
            k_narrow = best_depth(table, current, c.margin)
            if table[k_narrow] > self.value(batch, model, may, k, rates, paces) * (1.0 + c.margin):
                k, spec = k_narrow, narrow
        drafting = {r.rid for r in spec}
        # TurboSpec's draft-prefill skip threshold follows TurboSpec's verdict (plain tokens per ms: drafting
        # does not pay at this batch size), not the prices of requests waiting or prompts going in: those
        # pass, and a request whose draft prefill was skipped meanwhile could never draft after them
        held_off = k == 0 and best_depth(plain, 0, c.margin) > 0
        c.hold(batch, k, plain)
        c.settle(batch, k, [r for r in late if r.rid in drafting], [] if held_off else may)
        return k, spec if k > 0 else may  # at k = 0 nobody drafts; TurboSpec's probe picks among `may`

    def keeps_draft(self, view: SchedulerView) -> Callable[[RequestView], bool]:
        """A request that starts decoding at risk (its root alone, at the replica's measured iteration,
        falls behind its pace) keeps its draft prefill under load: skipped, the draft would not know it
        and nothing could bring it back to its pace (the catch-up of a whole prompt never pays in one step)."""
        return lambda r: self.state(r, view.replicas[r.replica].cost.t_spec_ms) == AT_RISK

    def shapes(self, batch: BatchView, model: PassCost) -> dict[str, Shape]:
        """The chains of `choose` (with TurboSpec's probe and pause), as trees where `Branches.widen` says
        and the batch is not `pressed`. A probe (drafting is off: k = 0) stays a chain: it measures the
        chains' acceptance, and side nodes would only add to its cost."""
        shapes = super().shapes(batch, model)
        spec = [r for r in batch.requests if shapes[r.rid].depth > 0]
        if not spec or self.control.current.get(batch.replica, 0) == 0:
            return shapes
        depth = max(shapes[r.rid].depth for r in spec)
        rates = self.control.acceptance.rates(batch.requests)
        _, step_ms = self.control.step_ms(batch, model, spec, depth)
        mine = {r.rid: expected_tokens(rates[r.rid], shapes[r.rid].depth) for r in batch.requests}
        if not self.pressed(batch, model, mine, step_ms) and \
                self.branches.widen(model, spec, depth, sum(mine.values()), step_ms):
            for r in spec:
                shapes[r.rid] = Shape(shapes[r.rid].depth, self.branches.width)
        return shapes

    def pressed(self, batch: BatchView, model: PassCost, tokens: dict[str, float], step_ms: float) -> bool:
        """Requests wait for admission; or a request of the batch that is not lost falls behind its pace
        even with its chain (`tokens`: each one's expected tokens this step of `step_ms`); or, beside
        others, one is at risk (its root alone falls behind): the pass's budget and time then belong to
        the SLOs' chains, not to side branches. A request alone keeps its trees while its chain keeps
        its pace (a critical request at concurrency 1 is at risk on its root alone)."""
        t = model.t_spec_ms
        states = {r.rid: self.state(r, t) for r in batch.requests}
        if batch.waiting > 0 or (len(batch.requests) > 1 and AT_RISK in states.values()):
            return True
        return any(r.pace_ms() * tokens[r.rid] < step_ms and states[r.rid] != LOST for r in batch.requests)

    def select(self, batch: BatchView, candidates: Trees, model: PassCost) -> Selected:
        """Every chain whole, and the side nodes that pay (`Branches.grow`)."""
        rates = self.control.acceptance.rates([r for r in batch.requests if r.rid in candidates])
        selected = self.branches.grow(batch, candidates, model, rates, {r.rid: r.pace_ms() for r in batch.requests})
        self.control.selected(candidates, selected)
        return selected

    def filler(self, rid: str) -> int:
        """The side nodes `rid` verifies this pass: `Branches.grow` adds them only within every kept pace."""
        return self.branches.side.get(rid, 0)

    def observe(self, record: IterationRecord) -> None:
        self.control.observe(record)
        self.branches.observe(record)

    def describe(self) -> dict:
        return {**super().describe(), "tree_width": self.branches.width}


__all__ = ["AT_RISK", "Joint", "LOST", "SLACK", "makes_late"]
