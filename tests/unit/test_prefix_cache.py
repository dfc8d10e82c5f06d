"""The automatic prefix cache, no processes: the block-key chain, the block manager's cache (reference
counts, LRU eviction order, what is never cached, nothing leaked under random operations), the runner
(only committed tokens are keyed; a request started from cached blocks gets the logits a computed one
gets) and the target engine (a chunk's cached start, exact greedy output with the cache on and off)."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.block_hash import ROOT, block_hashes, chain
from specserve.shared.runtime.block_manager import BlockManager, OutOfBlocks
from specserve.shared.runtime.random_model import write_random_model
from specserve.shared.runtime.runner import ModelRunner

BS = 4


def test_block_keys_chain_the_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2  # the partial block has no key
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS) == a
    assert block_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS)[0] == a[0]
    assert block_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS)[1] != a[1]
    # the same tokens after another block have another key: a key names everything before it too
    assert block_hashes([0, 0, 0, 0, 5, 6, 7, 8], BS)[1] != a[1]
    assert block_hashes([5, 6, 7, 8], BS, parent=a[0]) == a[1:]
    assert list(chain([1, 2, 3], BS)) == [] and block_hashes([], BS) == []
    assert block_hashes([1, 2, 3, 4], BS, ROOT) == block_hashes([1, 2, 3, 4], BS)
    assert len(set(block_hashes(list(range(64)), BS))) == 16


def _cached(bm: BlockManager, rid: str, tokens: list[int]) -> list[int]:
    """A request that writes `tokens`, keys them, and ends; its block table."""
    bm.append_slots({rid: len(tokens)})
    bm.cache(rid, tokens, len(tokens))
    table = bm.block_table(rid)
    bm.free(rid)
    return table


def test_refcounts_and_free_count() -> None:
    bm = BlockManager(8, BS)
    prompt = list(range(10))
    table = _cached(bm, "a", prompt)
    assert bm.num_cached_blocks == 2 and bm.num_evictable_blocks == 2
    assert bm.num_free_blocks == 8  # evictable blocks are free for allocation
    assert bm.adopt("b", prompt, len(prompt) - 1) == 8
    assert bm.block_table("b") == table[:2] and bm.num_slots("b") == 8
    assert bm.adopt("c", prompt, 5) == 4  # at most `limit` tokens, whole blocks
    assert bm._refs[table[0]] == 2 and bm._refs[table[1]] == 1
    assert bm.num_free_blocks == 6 and bm.num_evictable_blocks == 0
    bm.append_slots({"b": 2})  # its own writes go to a block of its own
    assert bm.block_table("b")[2] not in table[:2]
    bm.free("b")
    assert bm._refs[table[0]] == 1 and bm.num_evictable_blocks == 1
    bm.free("c")
    bm.check_invariants()
    assert bm.num_free_blocks == 8 and bm.num_evictable_blocks == 2
    assert bm.adopt("d", [9] + prompt[1:], 9) == 0 and "d" not in bm  # a miss takes nothing


def test_lru_eviction_order() -> None:
    bm = BlockManager(6, BS)
    a, b = list(range(100, 108)), list(range(200, 208))
    ta, tb = _cached(bm, "a", a), _cached(bm, "b", b)
    bm.append_slots({"x": BS * 2})  # the two plain free blocks
    assert bm.evictions == 0
    assert bm.adopt("a2", a, 8) == 8  # a is used again: b is now the least recently used
    bm.free("a2")
    bm.append_slots({"y": 1})
    # b's tail went first: its head is still cached (a prefix is useful without its tail)
    assert bm.evictions == 1 and bm.block_table("y") == [tb[1]]
    assert bm.cached_tokens(b) == BS and bm.cached_tokens(a) == 8
    bm.append_slots({"y": BS})
    assert bm.block_table("y")[1] == tb[0] and bm.cached_tokens(b) == 0
    bm.append_slots({"y": BS})
    assert bm.block_table("y")[2] == ta[1] and bm.cached_tokens(a) == BS
    with pytest.raises(OutOfBlocks):
        bm.append_slots({"z": BS + 1})  # two blocks, one free: nothing changed
    assert bm.cached_tokens(a) == BS
    bm.check_invariants()


def test_partial_and_shared_blocks() -> None:
    bm = BlockManager(8, BS)
    bm.append_slots({"a": 10})
    toks = list(range(10))
    assert bm.cache("a", toks, 10) == 2  # the third block is partial: never keyed
    assert bm.cache("a", toks, 10) == 0  # keyed once
    assert bm.cached_tokens(toks) == 8
    bm.append_slots({"a": 2})
    assert bm.cache("a", toks + [10, 11], 11) == 0  # block 2's slot 11 is not committed yet
    assert bm.cache("a", toks + [10, 11], 12) == 1
    # a block whose key another block holds stays out of the cache (the chain goes on)
    bm.append_slots({"b": 12})
    assert bm.cache("b", toks + [10, 11], 12) == 0 and bm.num_cached_blocks == 3
    assert bm.block_keys("b") == bm.block_keys("a")
    # cutting into a keyed block: the sole holder forgets the key; a shared one cannot be cut
    assert bm.adopt("c", toks, 9) == 8
    with pytest.raises(ValueError, match="shared cached block"):
        bm.truncate("c", 6)
    assert bm.num_slots("c") == 8
    bm.truncate("a", 10)
    assert bm.cached_tokens(toks + [10, 11]) == 8 and len(bm.block_keys("a")) == 2
    bm.free("c")
    bm.truncate("a", 6)
    assert bm.cached_tokens(toks) == 4 and bm.block_keys("a") == block_hashes(toks, BS)[:1]
    bm.check_invariants()


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_leak_nothing(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(24, BS)
    words = [[rng.randrange(5) for _ in range(40)] for _ in range(3)]  # few distinct prefixes: many hits
    live: dict[str, list[int]] = {}
    for step in range(600):
        op = rng.random()
        if op < 0.3 and len(live) < 6:
            rid, seq = f"r{step}", list(rng.choice(words)[: rng.randint(1, 40)])
            taken = bm.adopt(rid, seq, rng.randint(0, len(seq)))
            live[rid] = seq[:taken]
            if taken == 0:
                bm.add(rid)
        elif op < 0.6 and live:
            rid = rng.choice(list(live))
            n = rng.randint(0, 9)
            try:
                bm.append_slots({rid: n})
            except OutOfBlocks:
                continue
            live[rid] += [rng.randrange(5) for _ in range(n)]
            bm.cache(rid, live[rid], rng.randint(0, len(live[rid])))
        elif op < 0.75 and live:
            rid = rng.choice(list(live))
            n = rng.randint(0, len(live[rid]))
            try:
                bm.truncate(rid, n)
            except ValueError:
                continue  # a shared cached block: refused, nothing changed
            del live[rid][n:]
        elif live:
            rid = rng.choice(list(live))
            bm.free(rid)
            del live[rid]
        bm.check_invariants()
        for rid, seq in live.items():  # a keyed block holds what its key says
            assert bm.num_slots(rid) == len(seq)
            assert bm.block_keys(rid) == block_hashes(seq, BS)[: len(bm.block_keys(rid))]
    for rid in list(live):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == 24


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    return ModelRunner.from_dir(write_random_model(tmp_path_factory.mktemp("tiny")), num_blocks=64, block_size=BS)


def test_runner_keys_committed_tokens_only(runner: ModelRunner) -> None:
    prompt = list(range(1, 12))
    runner.forward([Chunk("a", prompt)])
    runner.forward([Tree("a", [20, 21, 22, 23, 24, 25], [-1, 0, 1, 0, 3, 4])])
    assert runner.cache_prefix("a", 100) == 2  # the pending tree's slots are not committed: 11 tokens
    runner.commit_tree("a", [0, 3, 4])  # 20, 23, 24 committed
    assert runner.history["a"] == prompt + [20, 23, 24]
    assert runner.cache_prefix("a", 13) == 1  # 13 tokens: the third block now, never the partial fourth
    assert runner.blocks.cached_tokens(prompt + [20, 23, 24, 7]) == 12
    assert runner.blocks.cached_tokens(prompt + [21, 22, 23, 24]) == 8  # the discarded branch is not cached
    runner.release("a")
    runner.blocks.check_invariants()
    assert runner.num_free_blocks == 64


def test_cached_start_gives_the_computed_logits(runner: ModelRunner) -> None:
    torch.manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (23,)).tolist()
    full = runner.forward([Chunk("x", prompt, logits_at=[22])])[0]
    runner.cache_prefix("x", 23)
    runner.release("x")
    assert runner.adopt_prefix("y", prompt, 22) == 20
    assert runner.history["y"] == prompt[:20]
    got = runner.forward([Chunk("y", prompt[20:], logits_at=[2])])[0]
    assert torch.equal(got, full)  # the compiled CPU pass: bit for bit
    runner.release("y")
    runner.blocks.check_invariants()


# ---- the services' engines, in process, on the bundled demo pair -------------------------------------------
def _greedy(engine, rid: str, prompt: list[int], chunks: list[int], steps: int, spec=None, logprobs=None):
    """A request prefilled in `chunks`, then `steps` root-only verify steps: its tokens, and the tokens each
    chunk took from the prefix cache (`logprobs`: a list the replies' logprobs rows are added to)."""
    from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec, VerifyEntry

    step, start, cached, out = 1, 0, [], []
    for n in chunks:
        first = spec or SamplingSpec()
        entry = PrefillEntry(rid, step, start, n, start + n == len(prompt), first if start == 0 else None)
        reply, payload = engine.forward(Forward(prefill=[entry]), {
            "prefill_tokens": torch.tensor(prompt[start:start + n], dtype=torch.int32)})
        assert reply.results[0].error is None, reply.results[0].error
        cached.append(reply.results[0].num_cached)
        if logprobs is not None:
            logprobs.append(payload["logprobs"].tolist() if "logprobs" in payload else [])
        out += payload["tokens"].tolist()
        start, step = start + n, step + 1
    for _ in range(steps):
        reply, payload = engine.forward(Forward(verify=[VerifyEntry(rid, step, len(prompt) + len(out), 1)]), {
            "tree_tokens": torch.tensor([out[-1]], dtype=torch.int32),
            "tree_parents": torch.tensor([-1], dtype=torch.int32)})
        out += payload["tokens"].tolist()
        step += 1
    return out, cached


def test_the_target_serves_cached_prefixes_with_the_same_greedy_output() -> None:
    from specserve.target.config import TargetConfig
    from specserve.target.engine import TargetEngine

    on, off = (TargetEngine(TargetConfig(kv_blocks=64, threads=1, prefix_caching=c)) for c in (True, False))
    prompt = [(37 * i + 11) % 4000 for i in range(70)]
    other = prompt[:40] + [5, 6, 7, 8, 9]
    for engine in (on, off):
        first, cached = _greedy(engine, "a", prompt, [70], 8)
        assert cached == [0]
        engine.release("a")
    turn2 = prompt + first  # a conversation re-sends its history
    cases = [("b", other, [45], [32]),  # the shared 40 tokens' whole blocks
             ("c", turn2, [len(turn2)], [(len(turn2) - 2) // 16 * 16]),  # the prompt and the output but its newest
             ("d", prompt, [32, 38], [16, 32]),  # a chunk that starts on a block boundary goes on from the cache
             ("e", prompt, [20, 50], [16, 0])]  # one that does not computes its tokens
    for rid, seq, chunks, want in cases:
        got, cached = _greedy(on, rid, seq, chunks, 6)
        ref, none = _greedy(off, rid, seq, chunks, 6)
        assert got == ref and cached == want and none == [0] * len(chunks), rid
        on.release(rid)
        off.release(rid)
    on.runner.blocks.check_invariants()
    stats = on.stats()
    assert stats.free_blocks == stats.total_blocks and stats.evictable_blocks == stats.cached_blocks > 0
    assert off.stats().cached_blocks == 0 and not off.stats().prefix_caching
    # logprobs of the output tokens are those of the cache-off engine; a request that asks for the prompt's
    # logprobs needs every prompt row's logits, so it takes nothing from the cache
    from specserve.shared.wire.messages import SamplingSpec

    # so do penalties, which count the prompt's tokens (those taken from the cache too)
    penalized = SamplingSpec(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3)
    got, cached = _greedy(on, "p", prompt, [70], 6, penalized)
    ref, _ = _greedy(off, "p", prompt, [70], 6, penalized)
    assert got == ref and cached == [64]
    on.release("p")
    off.release("p")
    for rid, spec, want in (("g", SamplingSpec(logprobs=2), [64]), ("h", SamplingSpec(logprobs=0, prompt_logprobs=True),
                                                                     [0])):
        rows_on, rows_off = [], []
        got, cached = _greedy(on, rid, prompt, [70], 0, spec, rows_on)
        ref, _ = _greedy(off, rid, prompt, [70], 0, spec, rows_off)
        assert got == ref and cached == want and rows_on == rows_off and len(rows_on[0]) == (70 if want == [0] else 1)
        on.release(rid)
        off.release(rid)
    # a pass that fails gives back what its chunks took from the cache, as it gives back the slots it took
    def broken(*_args):
        raise RuntimeError("the model pass failed")

    on.runner._compute = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the model pass failed"):
        _greedy(on, "f", prompt, [70], 0)
    assert not on.runner.has_request("f")
    on.runner.blocks.check_invariants()
    assert on.stats().free_blocks == on.stats().total_blocks and on.stats().evictable_blocks == stats.cached_blocks


def test_the_draft_catches_up_from_its_cache_with_the_same_trees() -> None:
    from specserve.draft.config import DraftConfig
    from specserve.draft.engine import DraftEngine
    from specserve.shared.wire.messages import Speculate, SpeculateEntry

    prompt = [(53 * i + 7) % 4000 for i in range(50)]

    def tree(engine: DraftEngine, rid: str) -> tuple[list, list]:
        reply, payload = engine.speculate(Speculate([SpeculateEntry(rid, 1, len(prompt), len(prompt), 3, 2)]),
                                          {"tokens": torch.tensor(prompt, dtype=torch.int32)})
        assert reply.trees[0].error is None and reply.trees[0].depth == 3
        return payload["tokens"].tolist(), payload["path_prob"].tolist()

    on, off = (DraftEngine(DraftConfig(kv_blocks=64, threads=1, prefix_caching=c)) for c in (True, False))
    first = tree(on, "a")
    blocks = on.runner.blocks.block_table("a")[:3]  # the newest token's block (the 4th) is never cached
    on.release("a")
    assert on.runner.blocks.cached_tokens(prompt) == 48 and on.stats().evictable_blocks == 3
    assert tree(on, "b") == first == tree(off, "b")
    assert on.runner.blocks.block_table("b")[:3] == blocks  # taken from the cache, not computed
    on.release("b")
    on.runner.blocks.check_invariants()
    assert on.stats().free_blocks == on.stats().total_blocks
