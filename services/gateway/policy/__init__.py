"""Speculation policies and their names (`--policy NAME`)."""

from __future__ import annotations

from specserve.gateway.policy.adaserve import AdaServe, EqualGreedy, GlobalGreedy
from specserve.gateway.policy.base import (
    BatchView,
    CandidateTree,
    Outcome,
    Plan,
    Policy,
    RequestView,
    Shape,
)
from specserve.gateway.policy.fixed import Chain, ExpansionTree

NAMES = ["adaserve", "none", "chain:K", "tree:W1,W2,...", "equal-greedy", "global-greedy"]
SPECINFER_TREE = [1, 1, 3, 1, 1, 1, 1, 1]


def make_policy(name: str, max_depth: int = 8, max_width: int = 4, max_added: int = 16) -> Policy:
    """Build a policy from its name; ValueError with the list of names if it is unknown."""
    kind, _, arg = name.partition(":")
    try:
        if kind == "none" and not arg:
            return Policy()
        if kind == "chain":
            return Chain(int(arg or 4))
        if kind == "tree":
            return ExpansionTree([int(x) for x in arg.split(",")] if arg else SPECINFER_TREE)
        budgeted = {"adaserve": AdaServe, "equal-greedy": EqualGreedy, "global-greedy": GlobalGreedy}
        if kind in budgeted and not arg:
            return budgeted[kind](max_depth, max_width, max_added)
    except ValueError as exc:
        raise ValueError(f"bad policy {name!r}: {exc}; choose one of: {', '.join(NAMES)}") from None
    raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(NAMES)}")


__all__ = ["BatchView", "CandidateTree", "Outcome", "Plan", "Policy", "RequestView", "Shape", "make_policy", "NAMES"]
