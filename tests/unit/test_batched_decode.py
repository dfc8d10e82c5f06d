"""The target's batched plain decodes (`TargetEngine._decode`, `ModelRunner.decode`, `BlockManager.append_one`,
`build_lean_inputs` with `Decodes`): the one-node trees of greedy requests run without the per-entry layers, their
inputs built by array operations, with the results, state, KV and prefix cache the general path gives; any other
entry goes the general path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.block_manager import BlockManager, OutOfBlocks
from specserve.shared.runtime.lean_inputs import Decodes, build_lean_inputs
from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec, VerifyEntry
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine

PROMPTS = {"a": 15, "b": 16, "c": 17, "d": 31, "e": 40}  # prompt lengths: blocks of 16 fill at different steps


def _prompt(rid: str, n: int) -> list[int]:
    return [(97 * i + 13 * ord(rid)) % 3000 + 5 for i in range(n)]


def _pair(kv_blocks: int) -> tuple[TargetEngine, TargetEngine]:
    """(batched, general): two engines of one model, the second with batched decodes off."""
    fast = TargetEngine(TargetConfig(kv_blocks=kv_blocks, threads=1))
    slow = TargetEngine(TargetConfig(kv_blocks=kv_blocks, threads=1))
    slow.batched_decodes = False
    return fast, slow


def _same(fast: TargetEngine, slow: TargetEngine, msg: Forward, tensors: dict[str, torch.Tensor]) -> list:
    """Run the call on both; their replies, payloads and state (but the physical blocks) agree. Returns the
    results."""
    r1, p1 = fast.forward(msg, {k: v.clone() for k, v in tensors.items()})
    r2, p2 = slow.forward(msg, {k: v.clone() for k, v in tensors.items()})
    assert r1.results == r2.results
    assert p1.keys() == p2.keys() and all(torch.equal(p1[k], p2[k]) for k in p1)
    assert (r1.free_blocks, r1.cached_blocks) == (r2.free_blocks, r2.cached_blocks)
    for e in (fast, slow):
        e.runner.blocks.check_invariants()
    assert fast.requests.keys() == slow.requests.keys()
    for rid, req in fast.requests.items():
        other = slow.requests[rid]
        assert (req.prefilled, req.committed, req.last_token, req.last_step) == \
            (other.prefilled, other.committed, other.last_token, other.last_step)
        # (which physical blocks: the plain decodes take theirs after the call's other entries)
        assert fast.runner.blocks.num_slots(rid) == slow.runner.blocks.num_slots(rid)
        assert len(fast.runner.blocks.block_table(rid)) == len(slow.runner.blocks.block_table(rid))
        assert fast.runner.blocks.block_keys(rid) == slow.runner.blocks.block_keys(rid)
        assert fast.runner.history[rid] == slow.runner.history[rid]
    return r1.results


def _start(fast: TargetEngine, slow: TargetEngine, specs: dict[str, SamplingSpec]) -> None:
    prompts = {rid: _prompt(rid, PROMPTS[rid]) for rid in specs}
    msg = Forward(prefill=[PrefillEntry(rid, 1, 0, len(p), True, specs[rid]) for rid, p in prompts.items()])
    flat = torch.tensor([t for p in prompts.values() for t in p], dtype=torch.int32)
    assert all(r.error is None for r in _same(fast, slow, msg, {"prefill_tokens": flat}))


def _decodes(engine: TargetEngine, rids: list[str], step: int, pending: frozenset[str] = frozenset(),
             stale: str = "") -> tuple[Forward, dict[str, torch.Tensor]]:
    """One plain decode of each request, as the gateway sends it (a root sent ahead as 0)."""
    reqs = engine.requests
    msg = Forward(verify=[VerifyEntry(rid, step - (rid == stale) * step, reqs[rid].committed, 1,
                                      root_pending=rid in pending) for rid in rids])
    roots = [0 if rid in pending else reqs[rid].last_token for rid in rids]
    return msg, {"tree_tokens": torch.tensor(roots, dtype=torch.int32),
                 "tree_parents": torch.full((len(rids),), -1, dtype=torch.int32)}


def test_batched_decodes_give_what_the_general_path_gives_and_other_calls_take_it() -> None:
    fast, slow = _pair(kv_blocks=64)
    _start(fast, slow, {rid: SamplingSpec() for rid in PROMPTS})
    rids = list(PROMPTS)
    for step in range(2, 40):  # crosses a block boundary of every request: new blocks, keyed blocks
        pending = frozenset(rids[::3]) if step % 2 else frozenset()
        results = _same(fast, slow, *_decodes(fast, rids, step, pending))
        assert all(r.error is None and r.num_tokens == 1 for r in results)
    assert fast.decode_calls == 38 and slow.decode_calls == 0
    assert fast.runner.blocks.num_cached_blocks > 8  # the output's full blocks were keyed as they filled

    # a call with any entry the batch does not take goes the general path, which refuses or runs it as before
    calls = fast.decode_calls
    _same(fast, slow, *_decodes(fast, rids, 40, stale="c"))  # a stale step: refused alone, the others run
    msg, tensors = _decodes(fast, rids, 41)
    tensors["tree_tokens"][1] = 4  # a wrong root
    assert _same(fast, slow, msg, tensors)[1].error.code == "out_of_sync"
    msg, tensors = _decodes(fast, rids, 42)
    tensors["tree_tokens"][2] = fast.vocab_size + 3
    _same(fast, slow, msg, tensors)
    msg, tensors = _decodes(fast, [*rids, "a"], 43)  # a request twice
    assert _same(fast, slow, msg, tensors)[-1].error.code == "duplicate_request"
    msg, tensors = _decodes(fast, rids, 44)
    _same(fast, slow, Forward(verify=[*msg.verify.entries(), VerifyEntry("zz", 44, 3, 1)]),
          {"tree_tokens": torch.cat([tensors["tree_tokens"], torch.tensor([5], dtype=torch.int32)]),
           "tree_parents": torch.full((6,), -1, dtype=torch.int32)})  # an unknown request
    assert fast.decode_calls == calls
    assert all(r.error is None for r in _same(fast, slow, *_decodes(fast, rids, 45)))
    assert fast.decode_calls == calls + 1


def test_plain_decodes_beside_prompt_chunks_and_trees_run_batched_with_the_same_results(monkeypatch) -> None:
    fast, slow = _pair(kv_blocks=64)
    _start(fast, slow, {rid: SamplingSpec() for rid in "abc"})
    # a prompt chunk beside three plain decodes: the chunk goes through the checks, the decodes do not
    msg, tensors = _decodes(fast, ["a", "b", "c"], 2, pending=frozenset("b"))
    prompt = _prompt("d", PROMPTS["d"])
    msg = Forward(prefill=[PrefillEntry("d", 1, 0, len(prompt), True, SamplingSpec())], verify=msg.verify)
    tensors["prefill_tokens"] = torch.tensor(prompt, dtype=torch.int32)
    assert all(r.error is None for r in _same(fast, slow, msg, tensors)) and fast.plain_entries == 3
    # a tree beside plain decodes: its own checks and acceptance, the others batched
    reqs = fast.requests
    msg, tensors = _decodes(fast, ["a", "c", "d"], 3)
    tree = VerifyEntry("b", 3, reqs["b"].committed, 3)
    entries = msg.verify.entries()
    msg = Forward(verify=[entries[0], tree, *entries[1:]])
    tensors = {"tree_tokens": torch.tensor([reqs["a"].last_token, reqs["b"].last_token, 7, 9, reqs["c"].last_token,
                                            reqs["d"].last_token], dtype=torch.int32),
               "tree_parents": torch.tensor([-1, -1, 0, 0, -1, -1], dtype=torch.int32)}
    assert all(r.error is None for r in _same(fast, slow, msg, tensors)) and fast.plain_entries == 6
    # a commit that fails ends that request alone, on either path
    failing = fast.runner.cache_prefix

    def fail_for(runner, rid_failing: str):
        def cache_prefix(rid: str, num_tokens: int) -> int:
            if rid == rid_failing:
                raise RuntimeError("the prefix cache failed")
            return failing(rid, num_tokens) if runner is fast.runner else original(rid, num_tokens)
        return cache_prefix

    original = slow.runner.cache_prefix
    for engine in (fast, slow):
        monkeypatch.setattr(engine.runner, "cache_prefix", fail_for(engine.runner, "c"))
    for step in range(4, 4 + 16):  # c's next block fills on one of these steps
        results = _same(fast, slow, *_decodes(fast, [r for r in "abcd" if r in fast.requests], step))
        if "c" not in fast.requests:
            break
    assert [r.error.code for r in results if r.error is not None] == ["internal"] and "c" not in slow.requests
    assert not fast.runner.has_request("c") and fast.decode_calls > 0


def test_requests_that_sample_penalize_or_ask_for_logprobs_go_the_general_path() -> None:
    fast, slow = _pair(kv_blocks=64)
    specs = {"a": SamplingSpec(), "b": SamplingSpec(temperature=0.8, seed=5), "c": SamplingSpec(logprobs=2),
             "d": SamplingSpec(repetition_penalty=1.3), "e": SamplingSpec()}
    _start(fast, slow, specs)
    assert [rid for rid, req in fast.requests.items() if req.plain] == ["a", "e"]
    for step, rids in enumerate((["a", "e"], ["a", "b", "e"], ["c"], ["d", "a"], ["e", "a"]), start=2):
        _same(fast, slow, *_decodes(fast, rids, step))
    assert fast.decode_calls == 2  # the calls of "a" and "e" alone


def test_a_request_whose_state_cannot_be_read_ends_alone() -> None:
    """A fault in reading one request's state while the plain decodes are picked ends that request alone, as the
    per-entry checks do, not the call."""
    from specserve.target.state import TargetRequest

    class Broken(TargetRequest):
        @property
        def last_step(self) -> int:
            raise RuntimeError("unreadable")

    fast, slow = _pair(kv_blocks=64)
    _start(fast, slow, {rid: SamplingSpec() for rid in ("a", "b", "c")})
    broken = Broken.__new__(Broken)
    for name in TargetRequest.__slots__:
        if name != "last_step":
            object.__setattr__(broken, name, getattr(fast.requests["b"], name))
    fast.requests["b"] = broken
    reply, _payload = fast.forward(*_decodes(fast, ["a", "b", "c"], 2))
    assert [(r.rid, r.error.code if r.error else None) for r in reply.results] == \
        [("a", None), ("b", "internal"), ("c", None)]
    assert "b" not in fast.requests and fast.plain_entries == 0  # (the call went the per-entry path)


def test_each_entry_reads_its_own_root_whatever_the_other_entries_hold() -> None:
    """An entry of no nodes before a one-node entry and a tree: the one-node entry's root is its own slice of
    "tree_tokens", not the node its index would name, so a wrong root is refused even where the tree's first node
    happens to be the request's newest token."""
    fast, slow = _pair(kv_blocks=64)
    _start(fast, slow, {rid: SamplingSpec() for rid in ("a", "b", "c")})
    reqs = fast.requests
    wrong = (reqs["b"].last_token + 1) % fast.vocab_size
    msg = Forward(verify=[VerifyEntry("a", 2, reqs["a"].committed, 0), VerifyEntry("b", 2, reqs["b"].committed, 1),
                          VerifyEntry("c", 2, reqs["c"].committed, 2)])
    tensors = {"tree_tokens": torch.tensor([wrong, reqs["b"].last_token, 5], dtype=torch.int32),
               "tree_parents": torch.tensor([-1, -1, 0], dtype=torch.int32)}
    codes = [r.error.code if r.error else None for r in _same(fast, slow, msg, tensors)]
    assert codes == ["empty_entry", "out_of_sync", "out_of_sync"]  # (c's root is b's token: not c's newest either)


def test_plain_decodes_that_do_not_fit_the_pool_are_refused_as_before() -> None:
    fast, slow = _pair(kv_blocks=11)  # a: 1 block, b: 1, c: 2, d: 2, e: 3 taken by the prompts; 2 free
    _start(fast, slow, {rid: SamplingSpec() for rid in PROMPTS})
    calls, refused = fast.decode_calls, []
    for step in range(2, 6):  # b's and d's blocks are full at once (16, 32 slots), a's after a step
        results = _same(fast, slow, *_decodes(fast, [r for r in PROMPTS if r in fast.requests], step))
        refused += [r.rid for r in results if r.error is not None]
    assert refused and fast.decode_calls < calls + 4


def test_append_one_is_append_slots_of_one_slot_each_and_all_or_nothing() -> None:
    a, b = BlockManager(6, 4), BlockManager(6, 4)
    for m in (a, b):
        m.append_slots({"x": 4, "y": 3, "z": 7})
    assert a.append_one(["x", "y", "z"]) == [4, 3, 7]
    b.append_slots({"x": 1, "y": 1, "z": 1})
    for rid in "xyz":
        assert a.block_table(rid) == b.block_table(rid) and a.num_slots(rid) == b.num_slots(rid)
    assert np.array_equal(a.block_tables(["x", "y", "z"]), b.block_tables(["x", "y", "z"]))
    a.check_invariants()
    before = {rid: (a.block_table(rid), a.num_slots(rid)) for rid in "xyz"}
    with pytest.raises(OutOfBlocks):  # y's and z's blocks are full: two new blocks, one free
        a.append_one(["x", "z", "y"])
    assert {rid: (a.block_table(rid), a.num_slots(rid)) for rid in "xyz"} == before
    assert a.append_one(["x", "y"]) == [5, 4] and a.num_free_blocks == 0
    a.check_invariants()


def test_decodes_beside_entries_get_the_lean_inputs_of_one_token_chunks() -> None:
    m = BlockManager(40, 4)
    counts = {"p": 3, "q": 4, "r": 9, "s": 16, "t": 5, "u": 2}
    m.append_slots(counts)
    others = [Chunk("t", [5, 6, 7], logits_at=[2]), Tree("u", [8, 9, 10], [-1, 0, 0])]
    starts = [m.num_slots("t"), m.num_slots("u")]
    m.append_slots({"t": 3, "u": 3})
    decodes = ["p", "q", "r", "s"]
    tokens = [11, 22, 33, 44]
    for beside in (others, []):
        at = m.append_one(decodes)
        chunks = [Chunk(rid, [t], logits_at=(0,)) for rid, t in zip(decodes, tokens)]
        ref = build_lean_inputs([*beside, *chunks], starts[:len(beside)] + at, m)
        got = build_lean_inputs(beside, starts[:len(beside)], m, decodes=Decodes(decodes, at, tokens))
        assert got.logits_splits == ref.logits_splits
        for name in ("input_ids", "positions", "logits_indices"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name
        for name in ("slot_mapping", "tables", "seq", "prefix", "extra_off", "extra_slots"):
            assert torch.equal(getattr(got.keys, name), getattr(ref.keys, name)), name


def test_a_failed_batched_pass_gives_back_the_slots_it_took(monkeypatch) -> None:
    fast, slow = _pair(kv_blocks=64)
    _start(fast, slow, {rid: SamplingSpec() for rid in PROMPTS})
    before = {rid: fast.runner.blocks.block_table(rid) for rid in PROMPTS}

    def broken(_lean):
        raise RuntimeError("the model pass failed")

    monkeypatch.setattr(fast.runner, "_run_lean", broken)
    with pytest.raises(RuntimeError, match="the model pass failed"):
        fast.forward(*_decodes(fast, list(PROMPTS), 2))
    assert {rid: fast.runner.blocks.block_table(rid) for rid in PROMPTS} == before
    assert all(fast.runner.num_tokens(rid) == PROMPTS[rid] for rid in PROMPTS)
    fast.runner.blocks.check_invariants()
    msg, tensors = _decodes(fast, list(PROMPTS), 2)  # beside a new request's prompt: it is gone again
    prompt = _prompt("f", 20)
    msg = Forward(prefill=[PrefillEntry("f", 1, 0, len(prompt), True, SamplingSpec())], verify=msg.verify)
    with pytest.raises(RuntimeError, match="the model pass failed"):
        fast.forward(msg, {**tensors, "prefill_tokens": torch.tensor(prompt, dtype=torch.int32)})
    assert {rid: fast.runner.blocks.block_table(rid) for rid in PROMPTS} == before and not fast.runner.has_request("f")
    fast.runner.blocks.check_invariants()
