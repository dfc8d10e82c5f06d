"""Drafting ahead (`--overlap`): the draft grows a request's next tree while the target verifies this one.

Beside each target pass, every request that speculates is sent to the draft with its committed
tokens and, marked as *assumed*, the path of the tree under verification that is most likely to be
accepted whole (the root path of the selected leaf with the highest path probability). The draft
grows a tree of depth d + 1 from the end of that path and then forgets the assumed tokens.

When the target's answer is exactly that path plus a bonus token that is one of the new tree's
first-level children (a *hit*), the subtree under that child is the next step's tree, depth d,
already drafted: the next iteration calls no draft for it on its critical path. On a miss the next
step either verifies its root alone while the draft grows a tree from that root (`--overlap-miss
root`: then the draft's first-level guess of the bonus token is all it must get right), or drafts its
tree before the pass as without --overlap (`draft`: a miss costs what it always did).

Lossless by construction: the target verifies every token and decides what is emitted; the draft
only proposes. Pure bookkeeping, no I/O: the engine sends the calls (passes.py, beside the pass).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.gateway.engine.drafting import draft_step
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.engine.table import RequestTable
from specserve.gateway.perf.record import IterationRecord
from specserve.gateway.sched.plan import IterationPlan
from specserve.gateway.sched.policy.base import CandidateTree
from specserve.shared.wire.service_client import SpeculateItem


@dataclass(slots=True)
class Guess:
    """One request's drafting-ahead call of this iteration."""

    path: list[int]  # assumed tokens after the root of the tree being verified (empty: the root alone)
    root: int  # the token the new tree grows from: path[-1], or the root being verified
    output_len: int  # tokens the request had emitted when the call was made


def assumed_path(tree: CandidateTree, selected: list[int]) -> list[int]:
    """Tokens (root excluded) on the root path of the selected leaf with the highest path probability;
    empty when only the root is verified. `selected` is parent-closed and holds the root."""
    chosen = set(selected)
    leaves = [v for v in selected if v and not any(c in chosen for c in tree.children[v])]
    if not leaves:
        return []
    v = max(leaves, key=lambda n: (tree.path_prob[n], tree.depths[n]))
    path = []
    while v > 0:
        path.append(tree.tokens[v])
        v = tree.parents[v]
    return path[::-1]


def next_tree(guess: Guess, tree: CandidateTree, emitted: list[int]) -> CandidateTree | None:
    """The next step's tree when the target emitted the assumed path plus one of the tree's first-level
    children (the subtree under that child: one level shallower than the tree); None on a miss."""
    if len(emitted) != len(guess.path) + 1 or emitted[:-1] != guess.path:
        return None
    bonus = emitted[-1]
    child = next((c for c in tree.children[0] if tree.tokens[c] == bonus), None)
    return None if child is None else tree.rerooted(child)


def held_trees(plan: IterationPlan, decoding: list[GenRequest]) -> dict[str, CandidateTree]:
    """The trees drafted ahead during the last pass, cut to this plan's depth; a request without one
    (a miss), or that the policy now gives d = 0, verifies its root alone."""
    trees: dict[str, CandidateTree] = {}
    for r in decoding:
        tree, r.next_tree = r.next_tree, None
        depth = plan.shapes[r.rid].depth
        if tree is not None and depth > 0:
            trees[r.rid] = tree if max(tree.depths) <= depth else tree.rerooted(0, depth)
    return trees


def guesses(plan: IterationPlan, decoding: list[GenRequest], trees: dict[str, CandidateTree],
            selected: dict[str, list[int]], max_depth: int) -> dict[str, tuple[Guess, SpeculateItem]]:
    """Per request that speculates: the guess of its answer and the draft entry growing its next tree
    from that guess (depth d + 1, at most the draft's `max_depth`: the first level is the guess of the
    bonus token). None while no draft is up (`max_depth` 0)."""
    out: dict[str, tuple[Guess, SpeculateItem]] = {}
    if max_depth <= 0:
        return out
    for r in decoding:
        shape = plan.shapes[r.rid]
        if shape.depth <= 0:
            continue
        tree = trees.get(r.rid)
        path = assumed_path(tree, selected.get(r.rid, [0])) if tree is not None else []
        r.draft_seen = True
        out[r.rid] = (Guess(path, path[-1] if path else r.output[-1], len(r.output)),
                      SpeculateItem(r.rid, draft_step(plan.step, beside=True), [*r.draft_unsent, *path],
                                    r.committed, min(shape.depth + 1, max_depth), shape.width, len(path)))
    return out


def keep_hits(table: RequestTable, ahead: dict[str, tuple[Guess, SpeculateItem]],
              drafted: dict[str, CandidateTree], record: IterationRecord) -> None:
    """After the commit: a request whose answer matched its guess keeps its next tree."""
    for rid, (guess, _) in ahead.items():
        tree, r = drafted.get(rid), table.requests.get(rid)
        if tree is None or r is None or r.finish_reason is not None or r.replica is None:
            continue
        r.next_tree = next_tree(guess, tree, r.output[guess.output_len:])
        record.draft.ahead_hits += r.next_tree is not None
