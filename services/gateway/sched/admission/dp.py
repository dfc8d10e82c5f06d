"""The planning DP of SLOs-Serve (digest §5), throughput variant with per-tier counts (§§5.2-5.4).

Nodes are prompts to prefill, sorted by prefill deadline: *forced* ones (admitted requests still
prefilling, and the virtual node 0 at `now`) and *new* ones (waiting requests offered to this
replica). A state is (last node i, new admissions per tier n); for each it keeps the Pareto front of
(memory used, prefill budget left at i's deadline). From predecessor j to i the budget grows by
PB*(d_i − d_j) for the decoders admitted up to j and shrinks by i's prompt; it must never go
negative. j never skips a forced node, so every admitted request keeps its guarantee. A terminal
state lies at or after the last forced node, fits the free memory and can sustain all its decoders
(`sustainable`). The objective is Σ_l w_l·n_l; the admitted set is found by backtracking.

The budget model is passed in (`Budget`): `window(ms, decoders per tier) -> tokens | None` and
`sustainable(decoders per tier) -> bool`, so the DP is independent of how PB* is computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Node:
    rid: str
    tier: int  # index into the planner's tiers
    prompt: int  # prompt tokens still to prefill
    deadline_ms: float  # prefill deadline (the TTFT SLO), ms from now
    blocks: int = 0  # KV blocks it reserves if admitted (forced nodes hold theirs already)
    forced: bool = False  # admitted already: must stay feasible


@dataclass(frozen=True, slots=True)
class Budget:
    window: Callable[[float, tuple[int, ...]], int | None]  # PB*(ms, decoders per tier); None: infeasible
    sustainable: Callable[[tuple[int, ...]], bool]  # one batch holds every decoder's due tokens


@dataclass(slots=True)
class DpResult:
    admitted: list[str]  # new nodes admitted, in deadline order
    declined: list[str]  # new nodes not admitted
    counts: tuple[int, ...]  # new admissions per tier
    forced_ok: bool  # the forced nodes alone were feasible (no deadline had to be moved)
    moved: dict[str, float] = field(default_factory=dict)  # forced rid -> the later deadline it was planned at
    relaxations: int = 0  # transitions tried (the planner's cost driver)


_State = tuple[int, float, int, tuple[int, ...], int]  # (memory, budget, prev node, prev counts, prev entry)


def plan(nodes: Sequence[Node], base: Sequence[int], free_memory: int, budget: Budget,
         weights: Sequence[float] | None = None) -> DpResult:
    """The admissions of new nodes with the largest Σ w·n such that every deadline is met."""
    tiers = len(base)
    w = list(weights) if weights is not None else [1.0] * tiers
    order = sorted(range(len(nodes)), key=lambda k: (nodes[k].deadline_ms, not nodes[k].forced, k))
    seq = [Node("", 0, 0, 0.0, 0, True)] + [nodes[k] for k in order]  # node 0: now
    moved = _move_forced(seq, base, budget)
    forced_ok = not moved
    if any(math.isinf(t) for t in moved.values()):  # a forced prompt can never finish: admit nothing
        return DpResult([], [nd.rid for nd in seq[1:] if not nd.forced], (0,) * tiers, False, moved)
    forced_upto, last_forced, final_forced = _forced_prefix(seq, tiers)
    fronts, relax = _relax(seq, base, forced_upto, last_forced, free_memory, budget)
    chosen, counts = _best(seq, fronts, base, forced_upto, final_forced, budget, w)
    picked = set(chosen)
    declined = [nd.rid for nd in seq[1:] if not nd.forced and nd.rid not in picked]
    return DpResult(chosen, declined, counts, forced_ok, moved, relax)


def _forced_prefix(seq: list[Node], tiers: int) -> tuple[list[tuple[int, ...]], list[int], int]:
    """Per index of `seq`: the forced nodes' decoders per tier up to and including it (node 0 counts
    none), and the latest forced index strictly before it; and the last forced index of all."""
    forced_upto: list[tuple[int, ...]] = []
    acc = [0] * tiers
    for i, nd in enumerate(seq):
        if i > 0 and nd.forced:
            acc[nd.tier] += 1
        forced_upto.append(tuple(acc))
    last_forced = [0] * len(seq)
    lf = 0
    for i, nd in enumerate(seq):
        last_forced[i] = lf
        if nd.forced:
            lf = i
    return forced_upto, last_forced, lf


def _relax(seq: list[Node], base: Sequence[int], forced_upto: list[tuple[int, ...]], last_forced: list[int],
           free_memory: int, budget: Budget) -> tuple[list[dict[tuple[int, ...], list[_State]]], int]:
    """The DP's Pareto fronts: per node and count of admitted new nodes per tier, the (memory, budget
    left) states that reach it with every deadline met; and the transitions tried."""
    tiers = len(base)
    fronts: list[dict[tuple[int, ...], list[_State]]] = [dict() for _ in seq]
    fronts[0][(0,) * tiers] = [(0, 0.0, -1, (), -1)]
    relax = 0
    for i in range(1, len(seq)):
        nd = seq[i]
        for j in range(last_forced[i], i):
            window = nd.deadline_ms - seq[j].deadline_ms
            for cnt, states in fronts[j].items():
                dec = tuple(b + f + c for b, f, c in zip(base, forced_upto[j], cnt, strict=True))
                gain = budget.window(window, dec)
                if gain is None:
                    continue
                if nd.forced:
                    new_cnt = cnt
                else:
                    new_cnt = cnt[:nd.tier] + (cnt[nd.tier] + 1,) + cnt[nd.tier + 1:]
                for e, (mem, pb, *_rest) in enumerate(states):
                    relax += 1
                    m = mem + (0 if nd.forced else nd.blocks)
                    left = pb + gain - nd.prompt
                    if m > free_memory or left < 0:
                        continue
                    _insert(fronts[i].setdefault(new_cnt, []), (m, left, j, cnt, e))
    return fronts, relax


def _best(seq: list[Node], fronts: list[dict[tuple[int, ...], list[_State]]], base: Sequence[int],
          forced_upto: list[tuple[int, ...]], final_forced: int, budget: Budget,
          w: list[float]) -> tuple[list[str], tuple[int, ...]]:
    """The best sustainable end state at or after the last forced node (largest Σ w·n, then the most
    budget left), and the new nodes on its path, in deadline order, with their counts per tier."""
    best: tuple[float, float, int, tuple[int, ...], int] | None = None  # (value, budget, node, counts, entry)
    for i in range(final_forced, len(seq)):
        for cnt, states in fronts[i].items():
            dec = tuple(b + f + c for b, f, c in zip(base, forced_upto[-1], cnt, strict=True))
            if not budget.sustainable(dec):
                continue
            value = sum(wl * c for wl, c in zip(w, cnt, strict=True))
            for e, (_m, pb, *_r) in enumerate(states):
                key = (value, pb)
                if best is None or key > best[:2]:
                    best = (value, pb, i, cnt, e)
    if best is None:
        return [], tuple(0 for _ in base)
    chosen: list[str] = []
    i, cnt, e = best[2], best[3], best[4]
    while i > 0:
        _m, _pb, j, pcnt, pe = fronts[i][cnt][e]
        if not seq[i].forced:
            chosen.append(seq[i].rid)
        i, cnt, e = j, pcnt, pe
    chosen.reverse()
    return chosen, best[3]


def _insert(front: list[_State], s: _State) -> None:
    """Keep only states not dominated in (less memory, more budget)."""
    for o in front:
        if o[0] <= s[0] and o[1] >= s[1]:
            return
    front[:] = [o for o in front if not (s[0] <= o[0] and s[1] >= o[1])]
    front.append(s)


def _move_forced(seq: list[Node], base: Sequence[int], budget: Budget) -> dict[str, float]:
    """Digest §5.6: if the forced nodes alone miss a deadline (a misprediction), plan that node at its
    earliest feasible time instead (found by doubling, then bisection). Mutates `seq` in place (kept
    sorted); returns the moved deadlines (inf: it can never finish with these decoders)."""
    moved: dict[str, float] = {}
    dec = list(base)
    pb, prev = 0.0, 0.0
    for i, nd in enumerate(seq):
        if i == 0 or not nd.forced:
            continue
        gain = budget.window(nd.deadline_ms - prev, tuple(dec))
        if gain is None or pb + gain < nd.prompt:
            t = _earliest(lambda window: budget.window(window, tuple(dec)), nd.prompt - pb,
                          max(nd.deadline_ms - prev, 0.0))
            moved[nd.rid] = math.inf if t is None else prev + t
            seq[i] = Node(nd.rid, nd.tier, nd.prompt, moved[nd.rid], nd.blocks, True)
            if t is None:
                break
            gain = budget.window(t, tuple(dec)) or 0
        pb = max(pb + gain - nd.prompt, 0.0)
        prev = seq[i].deadline_ms
        dec[nd.tier] += 1
    if moved:
        head, rest = seq[:1], seq[1:]
        rest.sort(key=lambda x: (x.deadline_ms, not x.forced))
        seq[:] = head + rest
    return moved


def _earliest(window: Callable[[float], int | None], need: float, lo: float, limit_ms: float = 1e9) -> float | None:
    """The shortest window (ms, above `lo`) whose budget reaches `need`; None if none up to `limit_ms`."""
    hi = max(lo * 2, 1.0)
    while True:
        g = window(hi)
        if g is not None and g >= need:
            break
        if hi >= limit_ms:
            return None
        hi *= 2
    for _ in range(24):  # to within (hi - lo) / 2^24
        mid = (lo + hi) / 2
        g = window(mid)
        if g is not None and g >= need:
            hi = mid
        else:
            lo = mid
    return hi


__all__ = ["Budget", "DpResult", "Node", "plan"]
