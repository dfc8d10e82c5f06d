"""The policy registry: every `--policy` choice, its help text and its options, declared once.

A policy is registered with its usage (`chain:K`), a one-line summary, a builder, and optionally an
options dataclass (a `Settings` class: each field is also a gateway flag and a
`SPECSERVE_GATEWAY_<FIELD>` variable). The gateway's `--policy` help, the list printed for an
unknown name and the option flags all come from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from specserve.gateway.sched.plan import BatchView, Decision, RequestView, Shape
from specserve.gateway.sched.policy.adaserve import AdaServe, EqualGreedy, GlobalGreedy
from specserve.gateway.sched.policy.base import CandidateTree, Policy
from specserve.gateway.sched.policy.fixed import Chain, ExpansionTree
from specserve.gateway.sched.policy.joint import Joint
from specserve.gateway.sched.policy.nightjar import Nightjar, NightjarOptions, parse_arms
from specserve.gateway.sched.policy.slo_goodput import SloGoodput
from specserve.gateway.sched.policy.tetris import Tetris
from specserve.gateway.sched.policy.turbospec import TurboSpec
from specserve.shared.process.settings import Settings, option

SPECINFER_TREE = [1, 1, 3, 1, 1, 1, 1, 1]
# `--policy` of the gateway and of `specserve up` (docs/lab/sweep_default.md, "The default: `joint`")
DEFAULT_POLICY = "joint"


@dataclass(slots=True, kw_only=True)
class TreeOptions(Settings):
    """Caps of the budgeted tree policies (AdaServe and its ablations)."""

    env_prefix: ClassVar[str] = "SPECSERVE_GATEWAY_"

    max_depth: int = option(8, "D_max, beam depth cap")
    max_width: int = option(4, "W_max, beam width cap")
    max_added: int = option(16, "n_max, most nodes AdaServe's SLO phase adds to one request")


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str  # what comes before ":" in --policy
    usage: str  # e.g. "chain:K"
    summary: str  # one line for --help
    build: Callable[[str, Any], Policy]  # (the argument after ":", the options instance) -> policy
    options: type[Settings] | None = None  # its options dataclass, if it has any


REGISTRY: dict[str, PolicySpec] = {}


def register(spec: PolicySpec) -> None:
    if spec.name in REGISTRY:
        raise ValueError(f"policy {spec.name!r} is registered twice")
    REGISTRY[spec.name] = spec


def _no_argument(cls: Callable[..., Policy]) -> Callable[[str, Any], Policy]:
    def build(arg: str, opts: Any) -> Policy:
        if arg:
            raise ValueError(f"takes no argument (got {arg!r})")
        return cls(opts.max_depth, opts.max_width, opts.max_added) if opts is not None else cls()

    return build


def _chain(arg: str, _opts: Any) -> Policy:
    return Chain(int(arg or 4))


def _tetris(arg: str, _opts: Any) -> Policy:
    parts = [int(x) for x in arg.split(",")] if arg else []
    if len(parts) > 2:
        raise ValueError(f"takes K or K,E (got {arg!r})")
    return Tetris(*parts)


def _chains(cls: type[TurboSpec]) -> Callable[[str, Any], Policy]:
    """TurboSpec's controller (chains of at most 7 tokens, or --max-depth if lower)."""
    def build(arg: str, opts: Any) -> Policy:
        if arg:
            raise ValueError(f"takes no argument (got {arg!r})")
        return cls(max_k=min(7, opts.max_depth))

    return build


def _joint(arg: str, opts: Any) -> Policy:
    """TurboSpec's chains (at most 7 tokens, or --max-depth if lower), widened to trees of --max-width."""
    if arg:
        raise ValueError(f"takes no argument (got {arg!r})")
    return Joint(max_k=min(7, opts.max_depth), tree_width=opts.max_width)


def _slo_goodput(arg: str, opts: Any) -> Policy:
    if arg:
        raise ValueError(f"takes no argument (got {arg!r})")
    return SloGoodput(max_depth=opts.max_depth, max_added=opts.max_added)


def _nightjar(arg: str, opts: Any) -> Policy:
    return Nightjar(parse_arms(arg), opts)


def _tree(arg: str, _opts: Any) -> Policy:
    return ExpansionTree([int(x) for x in arg.split(",")] if arg else SPECINFER_TREE)


register(PolicySpec("adaserve", "adaserve", "AdaServe: SLO-customized trees under budget B",
                    _no_argument(AdaServe), TreeOptions))
register(PolicySpec("none", "none", "plain continuous batching, no draft calls", _no_argument(lambda: Policy())))
register(PolicySpec("chain", "chain:K", "K draft tokens in a chain for every request", _chain))
register(PolicySpec("tree", "tree:W1,W2,...", "SpecInfer's fixed expansion tree (default 1,1,3,1,1,1,1,1)", _tree))
register(PolicySpec("equal-greedy", "equal-greedy", "AdaServe ablation: B split equally, greedy per request",
                    _no_argument(EqualGreedy), TreeOptions))
register(PolicySpec("global-greedy", "global-greedy", "AdaServe ablation: the throughput phase alone",
                    _no_argument(GlobalGreedy), TreeOptions))
register(PolicySpec("tetris", "tetris:K,E", "TETRIS: chains of K+E draft tokens, the batch's best C = min(N K, B - N) "
                    "verified (default 3,1)", _tetris))
register(PolicySpec("turbospec", "turbospec", "TurboSpec: the chain length (0 = no draft call) of the best "
                    "predicted goodput, per pass", _chains(TurboSpec), TreeOptions))
register(PolicySpec("nightjar", "nightjar[:DxW,...]", "Nightjar: a batch-size bandit over (d, w) arms (default "
                    "0x1,1x1,2x1,3x1,4x1,2x2,4x2), draft offload under KV pressure", _nightjar, NightjarOptions))
register(PolicySpec("slo-goodput", "slo-goodput", "AdaServe's SLO-customized selection under the goodput "
                    "model's budget at the running batch, off when drafting does not pay, hopeless "
                    "requests left out of the SLO phase", _slo_goodput, TreeOptions))
register(PolicySpec("joint", "joint", "chains of the goodput-optimal length (0 = no draft call); only the requests "
                    "at risk of their TPOT SLO draft when that buys more SLO goodput; lost requests never draft; "
                    "side branches where the draft offers them and they pay (the default)", _joint, TreeOptions))

NAMES = [spec.usage for spec in REGISTRY.values()]


def policy_help() -> str:
    return "; ".join(f"{s.usage}: {s.summary}" for s in REGISTRY.values())


def option_classes() -> list[type[Settings]]:
    """Every registered options dataclass, once (the gateway adds their fields as flags)."""
    out: list[type[Settings]] = []
    for spec in REGISTRY.values():
        if spec.options is not None and spec.options not in out:
            out.append(spec.options)
    return out


def make_policy(name: str, options: dict[type, Any] | None = None, **overrides: Any) -> Policy:
    """Build a policy from its `--policy` name. `options` maps an options class to its instance (from
    the flags); `overrides` set single option fields (tests). ValueError, listing the names, if the
    name or its argument is bad."""
    kind, _, arg = name.partition(":")
    spec = REGISTRY.get(kind)
    if spec is None:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(NAMES)}")
    opts: Any = None
    if spec.options is not None:
        opts = (options or {}).get(spec.options) or spec.options()
        known = {f.name for f in fields(opts)}
        opts = replace(opts, **{k: v for k, v in overrides.items() if k in known})
    try:
        return spec.build(arg, opts)
    except ValueError as exc:
        raise ValueError(f"bad policy {name!r}: {exc}; choose one of: {', '.join(NAMES)}") from None


__all__ = ["BatchView", "CandidateTree", "DEFAULT_POLICY", "Decision", "NAMES", "Policy", "PolicySpec", "REGISTRY",
           "RequestView", "Shape", "TreeOptions", "make_policy", "option_classes", "policy_help", "register"]
