"""No request can fail another inside the services: what goes wrong with one entry ends that entry.

The target and draft engines run in-process on the bundled demo pair. A call co-batches healthy
requests with a poisoned one: real poison (sampling values that used to make the sampler raise and
fail the whole Forward) and injected faults (a check, the acceptance, the KV commit, the draft's KV
fit or beam setup raising for one request). Every healthy request must get exactly what it gets
without the poison, the poisoned one either samples fine or gets ErrorInfo("internal") and then
holds no state and no KV blocks there, and the services keep serving it and the others afterwards.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import specserve.draft.engine as draft_engine
import specserve.target.engine as target_engine
from specserve.draft.config import DraftConfig
from specserve.draft.engine import DraftEngine
from specserve.shared.wire.messages import (
    ErrorInfo,
    Forward,
    PrefillEntry,
    SamplingSpec,
    Speculate,
    SpeculateEntry,
    VerifyEntry,
)
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine

KV_BLOCKS = 128
GREEDY = SamplingSpec(temperature=0.0)
POISON_SEED = 4242
PROMPTS = {  # token ids of the demo vocabulary (4096), different lengths
    "a": [72, 400, 1201, 33, 9, 870, 15, 3001, 77, 260, 41],
    "b": [5, 6, 7, 8, 900, 1900, 2900, 12, 13],
    "c": [1000 + 17 * i for i in range(23)],
}
POISON_PROMPT = [11, 22, 33, 44, 55, 66, 77]
_steps = itertools.count(1)


@pytest.fixture(scope="module")
def target() -> TargetEngine:
    return TargetEngine(TargetConfig(kv_blocks=KV_BLOCKS, threads=1))


@pytest.fixture(scope="module")
def draft() -> DraftEngine:
    return DraftEngine(DraftConfig(kv_blocks=KV_BLOCKS, threads=1))


# ---- target -------------------------------------------------------------------------------------
def decode(engine: TargetEngine, requests: dict[str, tuple[list[int], SamplingSpec]], steps: int,
           drafts: dict[str, list[int]] | None = None) -> dict[str, list[int] | ErrorInfo]:
    """Prefill every prompt in one Forward, then `steps` Forwards of one tree per request: a chain of
    the next two tokens of `drafts` (so they are accepted when right) or the root alone."""
    out: dict[str, list[int] | ErrorInfo] = {}
    prefill = [PrefillEntry(rid, next(_steps), 0, len(p), True, spec) for rid, (p, spec) in requests.items()]
    tensors = {"prefill_tokens": torch.tensor([t for p, _ in requests.values() for t in p], dtype=torch.int32)}
    collect(engine, Forward(prefill=prefill), tensors, out)
    for _ in range(steps):
        live = {rid: toks for rid, toks in out.items() if isinstance(toks, list)}
        verify, tokens, parents = [], [], []
        for rid, toks in live.items():
            chain = (drafts or {}).get(rid, [])[len(toks) : len(toks) + 2]
            tree = [toks[-1], *chain]
            verify.append(VerifyEntry(rid, next(_steps), len(requests[rid][0]) + len(toks), len(tree)))
            tokens += tree
            parents += list(range(-1, len(tree) - 1))
        collect(engine, Forward(verify=verify), {"tree_tokens": torch.tensor(tokens, dtype=torch.int32),
                                                 "tree_parents": torch.tensor(parents, dtype=torch.int32)}, out)
    return out


def collect(engine: TargetEngine, msg: Forward, tensors: dict, out: dict) -> None:
    reply, payload = engine.forward(msg, tensors)
    emitted = payload["tokens"].tolist()
    for result in reply.results:
        toks, emitted = emitted[: result.num_tokens], emitted[result.num_tokens :]
        if result.error is not None:
            out[result.rid] = result.error
        else:
            out.setdefault(result.rid, []).extend(toks)  # type: ignore[union-attr]


def release_all(engine) -> None:
    for rid in list(engine.requests):
        engine.release(rid)
    assert engine.runner.num_free_blocks == KV_BLOCKS and not engine.requests


@pytest.fixture(scope="module")
def control(target) -> dict[str, list[int]]:
    """Greedy output of the healthy requests alone (root-only trees, one token per step)."""
    out = decode(target, {f"control-{k}": (p, GREEDY) for k, p in PROMPTS.items()}, 12)
    out.update(decode(target, {"control-poison": (POISON_PROMPT, GREEDY)}, 6))
    release_all(target)
    return {rid.removeprefix("control-"): toks for rid, toks in out.items()}


def run_with_poison(target, control, tag: str, spec: SamplingSpec, poison_drafts: bool = False) -> tuple[dict, str]:
    """poison_drafts: the poisoned request's steps are chains too (a root-only step of a greedy request commits
    no tree and runs batched, without the per-entry check and acceptance: TargetEngine._plain_decodes)."""
    for rid in list(target.requests):  # whatever an earlier failing test left behind
        target.release(rid)
    healthy = {f"{tag}-{k}": (p, GREEDY) for k, p in PROMPTS.items()}
    poison = f"{tag}-poison"
    drafts = {f"{tag}-{k}": control[k] for k in PROMPTS}
    if poison_drafts:
        drafts[poison] = control["poison"]
    out = decode(target, {**healthy, poison: (POISON_PROMPT, spec)}, 4, drafts)
    for k in PROMPTS:
        toks = out[f"{tag}-{k}"]
        assert isinstance(toks, list) and len(toks) > 5, (k, toks)  # drafts were accepted: trees with commits
        assert toks == control[k][: len(toks)], k
    return out, poison


@pytest.mark.parametrize("spec", [
    SamplingSpec(temperature=1e-38),  # inf - inf = NaN in the float32 sampler: the whole Forward failed
    SamplingSpec(temperature=5e-324),
    SamplingSpec(temperature=1.0, top_p=1e-300),  # 1e-300 was 0 in float32: every token masked
    SamplingSpec(temperature=0.3, top_p=5e-324, top_k=10**30),
], ids=["t1e-38", "t5e-324", "top_p1e-300", "top_k1e30"])
def test_extreme_sampling_values_sample_alone(target, control, spec):
    out, poison = run_with_poison(target, control, f"extreme-{spec.temperature}-{spec.top_p}", spec)
    # All of these are greedy in the limit: the poison gets its own greedy output, and nobody an error.
    assert out[poison] == control["poison"][: len(out[poison])] and len(out[poison]) == 5
    release_all(target)


def test_a_failing_acceptance_ends_its_request_alone(target, control, monkeypatch):
    real = target_engine.accept_tree

    def accept_tree(tokens, parents, logits, params, generator=None, history=None, greedy=None):
        if params.seed == POISON_SEED:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(tokens, parents, logits, params, generator, history, greedy=greedy)

    monkeypatch.setattr(target_engine, "accept_tree", accept_tree)
    out, poison = run_with_poison(target, control, "accept", SamplingSpec(temperature=0.0, seed=POISON_SEED))
    assert_ended_alone(target, out, poison, "acceptance failed (RuntimeError: probability tensor")


def test_a_failing_commit_ends_its_request_alone(target, control, monkeypatch):
    real = target.runner.commit_tree

    def commit_tree(rid, path):
        if rid.endswith("-poison"):
            raise IndexError("slot out of range")
        return real(rid, path)

    monkeypatch.setattr(target.runner, "commit_tree", commit_tree)
    out, poison = run_with_poison(target, control, "commit", GREEDY, poison_drafts=True)
    assert_ended_alone(target, out, poison, "acceptance failed (IndexError: slot out of range")


def test_a_failing_check_ends_its_request_alone(target, control, monkeypatch):
    real = target._check_verify

    def check_verify(entry, tokens, parents, seen):
        if entry.rid.endswith("-poison"):
            raise KeyError("oops")
        return real(entry, tokens, parents, seen)

    monkeypatch.setattr(target, "_check_verify", check_verify)
    out, poison = run_with_poison(target, control, "check", GREEDY, poison_drafts=True)
    assert_ended_alone(target, out, poison, "check failed (KeyError")


def assert_ended_alone(engine: TargetEngine, out: dict, poison: str, message: str) -> None:
    result = out[poison]
    assert isinstance(result, ErrorInfo) and result.code == "internal" and message in result.message, result
    assert "the request was released" in result.message
    assert poison not in engine.requests and not engine.runner.has_request(poison)
    # the healthy ones hold exactly their committed KV (all but the newest token), the poisoned one nothing
    held = sum(engine.runner.blocks.blocks_needed(r.committed - 1) for r in engine.requests.values())
    assert len(engine.requests) == len(PROMPTS) and KV_BLOCKS - engine.runner.num_free_blocks == held
    release_all(engine)


# ---- draft --------------------------------------------------------------------------------------
def speculate(engine: DraftEngine, entries: list[tuple[str, list[int], int]], depth: int = 3, width: int = 2):
    """entries: (rid, new tokens, committed after them) -> {rid: (tokens, parents, path_prob) or ErrorInfo}."""
    msg = Speculate([SpeculateEntry(rid, next(_steps), len(new), committed, depth, width)
                     for rid, new, committed in entries])
    reply, payload = engine.speculate(msg, {"tokens": torch.tensor([t for _, n, _ in entries for t in n],
                                                                   dtype=torch.int32)})
    tokens, parents, probs = (payload[k].tolist() for k in ("tokens", "parents", "path_prob"))
    out = {}
    for tree in reply.trees:
        n = tree.num_nodes
        out[tree.rid] = tree.error if tree.error else (tokens[:n], parents[:n], probs[:n])
        tokens, parents, probs = tokens[n:], parents[n:], probs[n:]
    return out


def draft_round(engine: DraftEngine, tag: str) -> tuple[dict, dict]:
    """Two calls: every prompt, then one more token each (the poison's prompt among them)."""
    prompts = {f"{tag}-{k}": p for k, p in PROMPTS.items()} | {f"{tag}-poison": POISON_PROMPT}
    first = speculate(engine, [(rid, p, len(p)) for rid, p in prompts.items()])
    second = speculate(engine, [(rid, [7], len(p) + 1) for rid, p in prompts.items() if isinstance(first[rid], tuple)])
    return first, second


def same_tree(a, b) -> bool:
    return a[0] == b[0] and a[1] == b[1] and all(abs(x - y) < 1e-5 for x, y in zip(a[2], b[2]))


@pytest.mark.parametrize("where", ["check", "fit", "beam_setup"])
def test_a_failing_draft_request_ends_alone(draft, monkeypatch, where):
    control_first, control_second = draft_round(draft, f"dcontrol-{where}")
    for rid in list(draft.requests):
        draft.release(rid)
    free = draft.runner.num_free_blocks

    tag = f"d{where}"
    poison = f"{tag}-poison"
    if where == "check":
        real_check = draft_engine.check_entry

        def check(entry, *args):
            if entry.rid == poison:
                raise KeyError("oops")
            return real_check(entry, *args)

        monkeypatch.setattr(draft_engine, "check_entry", check)
    elif where == "fit":
        real_fit = draft.runner.blocks.extra_blocks_for

        def extra_blocks_for(rid, extra):
            if rid == poison:
                raise KeyError("oops")
            return real_fit(rid, extra)

        monkeypatch.setattr(draft.runner.blocks, "extra_blocks_for", extra_blocks_for)
    else:
        real_beam = draft_engine.BeamRequest

        def beam_request(rid, *args):
            if rid == poison:
                raise KeyError("oops")
            return real_beam(rid, *args)

        monkeypatch.setattr(draft_engine, "BeamRequest", beam_request)
    first, second = draft_round(draft, tag)
    monkeypatch.undo()

    error = first[poison]
    assert isinstance(error, ErrorInfo) and error.code == "internal" and "KeyError" in error.message, error
    assert poison not in draft.requests and not draft.runner.has_request(poison)
    for k in PROMPTS:
        assert same_tree(first[f"{tag}-{k}"], control_first[f"dcontrol-{where}-{k}"]), k
        assert same_tree(second[f"{tag}-{k}"], control_second[f"dcontrol-{where}-{k}"]), k
    assert poison not in second
    # The gateway then resends all its committed tokens: it is a new request and speculates as one.
    again = speculate(draft, [(poison, POISON_PROMPT, len(POISON_PROMPT))])[poison]
    assert same_tree(again, control_first[f"dcontrol-{where}-poison"])
    for rid in list(draft.requests):
        draft.release(rid)
    assert draft.runner.num_free_blocks == free and not draft.requests
