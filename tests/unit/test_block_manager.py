"""Randomized checks of KV block accounting: the BlockManager alone, then through ModelRunner.

Both tests drive the system under test with a long random sequence of operations (fixed seeds)
and after every single operation compare it with a trivially simple independent model:
a dict request_id -> number of slots (tokens). The free block count must match exactly, no
physical block may be shared, and failed operations (OutOfBlocks, UnknownRequest, ValueError,
PendingTree) must change nothing at all.
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.block_manager import BlockManager, OutOfBlocks, UnknownRequest
from specserve.shared.runtime.random_model import write_random_model
from specserve.shared.runtime.runner import ModelRunner, PendingTree
from specserve.shared.spec.token_tree import path_to


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ======================================================================================
# BlockManager
# ======================================================================================


class BMModel:
    """Independent reference model of the block manager: only slot counts per request."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.bs = block_size
        self.slots: dict[str, int] = {}

    def blocks_of(self, n: int) -> int:
        return ceil_div(n, self.bs)

    @property
    def used(self) -> int:
        return sum(self.blocks_of(n) for n in self.slots.values())

    @property
    def free(self) -> int:
        return self.num_blocks - self.used

    def needed(self, counts: dict[str, int]) -> int:
        return sum(
            self.blocks_of(self.slots.get(rid, 0) + n) - self.blocks_of(self.slots.get(rid, 0))
            for rid, n in counts.items()
        )


def snapshot(bm: BlockManager) -> tuple:
    return (
        bm.num_free_blocks,
        sorted((rid, bm.num_slots(rid), tuple(bm.block_table(rid))) for rid in bm.request_ids()),
    )


def check_against_model(bm: BlockManager, model: BMModel) -> None:
    bm.check_invariants()
    assert bm.num_free_blocks == model.free
    assert bm.num_used_blocks == model.used
    assert sorted(bm.request_ids()) == sorted(model.slots)
    seen_blocks: dict[int, str] = {}
    seen_phys: set[int] = set()
    for rid, n in model.slots.items():
        assert rid in bm
        assert bm.num_slots(rid) == n
        table = bm.block_table(rid)
        assert len(table) == model.blocks_of(n), (rid, n, table)
        for b in table:
            assert 0 <= b < bm.num_blocks
            assert b not in seen_blocks, f"block {b} shared by {seen_blocks[b]} and {rid}"
            seen_blocks[b] = rid
        phys = bm.physical_slots(rid, 0, n)
        assert phys == [table[s // model.bs] * model.bs + s % model.bs for s in range(n)]
        assert not seen_phys & set(phys)
        seen_phys |= set(phys)
        assert bm.extra_blocks_for(rid, 0) == 0
    assert len(seen_blocks) == model.used


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_block_manager_random_ops(seed: int) -> None:
    rng = random.Random(seed)
    block_size = [1, 2, 3, 4, 16, 5][seed % 6]
    num_blocks = rng.randint(8, 40)
    bm = BlockManager(num_blocks, block_size)
    model = BMModel(num_blocks, block_size)
    next_id = 0
    counters: dict[str, int] = {}

    def new_rid() -> str:
        nonlocal next_id
        next_id += 1
        return f"r{next_id}"

    def expect_unchanged(exc_type, fn, *args):
        before = snapshot(bm)
        with pytest.raises(exc_type) as info:
            fn(*args)
        assert snapshot(bm) == before
        return info.value

    def do_append(counts: dict[str, int]) -> None:
        old_tables = {rid: bm.block_table(rid) for rid in counts if rid in bm}
        needed = model.needed(counts)
        assert sum(bm.extra_blocks_for(rid, n) for rid, n in counts.items()) == needed
        if needed > model.free:
            err = expect_unchanged(OutOfBlocks, bm.append_slots, counts)
            assert err.needed == needed and err.free == model.free
            assert err.request_ids == list(counts)
            counters["oob"] = counters.get("oob", 0) + 1
            return
        bm.append_slots(counts)
        for rid, n in counts.items():
            model.slots[rid] = model.slots.get(rid, 0) + n
            # Growing never moves existing slots: the old table is a prefix of the new one.
            new_table = bm.block_table(rid)
            assert new_table[: len(old_tables.get(rid, []))] == old_tables.get(rid, [])
        counters["append"] = counters.get("append", 0) + 1

    ops = ["add", "append1", "appendN", "truncate", "free", "oob", "bad"]
    weights = [2, 6, 4, 4, 2, 2, 2]
    for _ in range(1000):
        op = rng.choices(ops, weights)[0]
        live = list(model.slots)
        if op == "add" or (not live and op in ("append1", "truncate", "free")):
            rid = new_rid()
            if rng.random() < 0.5:
                bm.add(rid)
                model.slots[rid] = 0
            else:  # append_slots adds unknown requests
                do_append({rid: rng.randint(0, 3 * block_size)})
        elif op == "append1":
            rid = rng.choice(live)
            do_append({rid: rng.choice([0, 1, 1, 2, block_size, rng.randint(0, 4 * block_size)])})
        elif op == "appendN":
            k = rng.randint(1, min(4, len(live) + 1)) if live else 1
            rids = rng.sample(live, min(k, len(live)))
            if rng.random() < 0.3:
                rids.append(new_rid())
            rng.shuffle(rids)
            do_append({rid: rng.randint(0, 3 * block_size) for rid in rids})
        elif op == "truncate":  # "commit": shrink after a tree
            rid = rng.choice(live)
            old = bm.block_table(rid)
            k = rng.randint(0, model.slots[rid])
            bm.truncate(rid, k)
            model.slots[rid] = k
            assert bm.block_table(rid) == old[: model.blocks_of(k)]
        elif op == "free":
            rid = rng.choice(live)
            bm.free(rid)
            del model.slots[rid]
            expect_unchanged(UnknownRequest, bm.free, rid)
        elif op == "oob":
            # A batch whose blocks exceed the free count, possibly with parts that would fit alone.
            rids = rng.sample(live, min(rng.randint(0, 3), len(live))) + [new_rid()]
            rng.shuffle(rids)
            counts = {rid: rng.randint(0, 2 * block_size) for rid in rids}
            target = rng.choice(rids)
            counts[target] += (model.free + rng.randint(1, 3)) * block_size
            assert model.needed(counts) > model.free
            do_append(counts)
        else:  # operations that must fail and change nothing
            ghost = "ghost-" + new_rid()
            kind = rng.randrange(6)
            if kind == 0:
                expect_unchanged(UnknownRequest, bm.free, ghost)
            elif kind == 1:
                expect_unchanged(UnknownRequest, bm.truncate, ghost, 0)
            elif kind == 2:
                expect_unchanged(UnknownRequest, bm.num_slots, ghost)
            elif kind == 3 and live:
                rid = rng.choice(live)
                expect_unchanged(ValueError, bm.truncate, rid, model.slots[rid] + rng.randint(1, 5))
            elif kind == 4 and live:
                expect_unchanged(ValueError, bm.add, rng.choice(live))
            elif kind == 5 and live:
                counts = {rid: 1 for rid in rng.sample(live, min(2, len(live)))}
                counts[ghost] = -1
                expect_unchanged(ValueError, bm.append_slots, counts)
            assert ghost not in bm
        check_against_model(bm, model)

    # The run must actually have exercised both outcomes of append_slots.
    assert counters.get("oob", 0) > 20 and counters.get("append", 0) > 100
    for rid in list(model.slots):
        bm.free(rid)
        del model.slots[rid]
        check_against_model(bm, model)
    assert bm.num_free_blocks == num_blocks
    # Every block is allocatable again: one request can take the whole pool, and no more.
    bm.append_slots({"all": num_blocks * block_size})
    assert sorted(bm.block_table("all")) == list(range(num_blocks))
    with pytest.raises(OutOfBlocks) as info:
        bm.append_slots({"x": 1})
    assert (info.value.needed, info.value.free) == (1, 0)


def test_block_manager_edge_cases() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    bm = BlockManager(3, 4)
    bm.append_slots({"a": 4})  # exactly one block
    assert len(bm.block_table("a")) == 1
    bm.append_slots({"a": 1})  # a fifth slot starts a second block
    assert len(bm.block_table("a")) == 2
    bm.append_slots({"a": 3})  # fills the second block, no new block
    assert bm.num_free_blocks == 1
    with pytest.raises(IndexError):
        bm.physical_slots("a", 5, 4)
    with pytest.raises(IndexError):
        bm.physical_slots("a", -1, 1)
    # Atomicity across requests: "b" alone would fit, the batch does not.
    with pytest.raises(OutOfBlocks) as info:
        bm.append_slots({"b": 4, "c": 4})
    assert (info.value.needed, info.value.free) == (2, 1)
    assert "b" not in bm and "c" not in bm and bm.num_free_blocks == 1
    bm.truncate("a", 0)
    assert bm.block_table("a") == [] and bm.num_free_blocks == 3
    with pytest.raises(UnknownRequest):
        bm.block_table("nope")
    with pytest.raises(UnknownRequest):
        bm.physical_slots("nope", 0, 0)


# ======================================================================================
# ModelRunner
# ======================================================================================

BLOCK_SIZE = 4



@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny_model"))


def random_tree(rng: random.Random, vocab: int, max_nodes: int) -> tuple[list[int], list[int]]:
    n = rng.randint(1, max_nodes)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return tokens, parents


@pytest.mark.parametrize("seed", [0, 1])
def test_runner_random_ops(tiny_model_dir, seed: int) -> None:
    torch.manual_seed(seed)
    rng = random.Random(1000 + seed)
    num_blocks = 32
    bs = BLOCK_SIZE
    runner = ModelRunner.from_dir(tiny_model_dir, num_blocks=num_blocks, block_size=bs)
    ref = ModelRunner(runner.model, num_blocks=64, block_size=bs)  # same weights, own pool
    vocab = runner.config.vocab_size

    seqs: dict[str, list[int]] = {}  # committed tokens (KV in the cache) per live request
    pending: dict[str, tuple[list[int], list[int]]] = {}  # uncommitted tree per request
    next_id = 0
    stats: dict[str, int] = {}

    def bump(key: str) -> None:
        stats[key] = stats.get(key, 0) + 1

    released: list[str] = []

    def new_rid() -> str:
        nonlocal next_id
        if released and rng.random() < 0.3:  # ids of released requests may come back
            return released.pop(rng.randrange(len(released)))
        next_id += 1
        return f"q{next_id}"

    def expected_free() -> int:
        used = sum(ceil_div(len(s) + len(pending[rid][0]) if rid in pending else len(s), bs)
                   for rid, s in seqs.items())
        return num_blocks - used

    def check() -> None:
        runner.blocks.check_invariants()
        assert sorted(runner.blocks.request_ids()) == sorted(seqs)
        for rid, s in seqs.items():
            assert runner.has_request(rid)
            assert runner.num_tokens(rid) == len(s)
        assert runner.num_free_blocks == expected_free()
        if not pending:
            live_blocks = sum(ceil_div(runner.num_tokens(rid), bs) for rid in seqs)
            assert runner.num_free_blocks == num_blocks - live_blocks

    def state() -> tuple:
        return runner.num_free_blocks, {rid: runner.num_tokens(rid) for rid in seqs}, snapshot(runner.blocks)

    def reference_logits(context: list[int]) -> torch.Tensor:
        """Next-token logits after `context`, from a fresh one-shot prefill."""
        out = ref.forward([Chunk("ref", list(context), logits_at=[len(context) - 1])])[0][0]
        ref.release("ref")
        return out

    def verify(entry, logits: torch.Tensor, force: bool) -> None:
        """Spot-check one returned row against the reference (checks KV content, not just counts)."""
        if logits.shape[0] == 0 or not (force or rng.random() < 0.4):
            return
        row = rng.randrange(logits.shape[0])
        base = seqs.get(entry.request_id, [])
        if isinstance(entry, Tree):
            node = list(range(len(entry.tokens)))[row] if entry.logits_at is None else entry.logits_at[row]
            context = base + [entry.tokens[i] for i in path_to(entry.parents, node)]
        else:
            context = base + entry.tokens[: entry.logits_at[row] + 1]
        torch.testing.assert_close(logits[row], reference_logits(context), rtol=1e-4, atol=1e-4)
        bump("verified")

    def make_entry(rid: str, kind: str):
        if kind == "tree":
            tokens, parents = random_tree(rng, vocab, 9)
            n = len(tokens)
            logits_at = None if rng.random() < 0.5 else sorted(rng.sample(range(n), rng.randint(0, n)))
            return Tree(rid, tokens, parents, logits_at)
        n = 1 if kind == "decode" else rng.randint(1, 10)
        tokens = [rng.randrange(vocab) for _ in range(n)]
        return Chunk(rid, tokens, sorted(rng.sample(range(n), rng.randint(0, min(n, 3)))))

    def apply(entries, force_verify: bool = False) -> None:
        have = [len(seqs.get(e.request_id, [])) for e in entries]
        needed = sum(ceil_div(h + len(e.tokens), bs) - ceil_div(h, bs) for h, e in zip(have, entries))
        if needed > expected_free():
            before = state()
            with pytest.raises(OutOfBlocks) as info:
                runner.forward(entries)
            assert info.value.needed == needed and info.value.free == expected_free()
            assert state() == before
            bump("oob")
            return
        outs = runner.forward(entries)
        assert len(outs) == len(entries)
        for e, out in zip(entries, outs):
            n_rows = len(e.tokens) if isinstance(e, Tree) and e.logits_at is None else len(e.logits_at)
            assert out.shape == (n_rows, vocab) and out.dtype == torch.float32
            verify(e, out, force_verify)
            if isinstance(e, Tree):
                seqs.setdefault(e.request_id, [])
                pending[e.request_id] = (e.tokens, e.parents)
                bump("tree")
            else:
                seqs.setdefault(e.request_id, []).extend(e.tokens)
                bump("chunk")

    def idle() -> list[str]:
        return [rid for rid in seqs if rid not in pending]

    ops = ["prefill", "decode", "tree", "batch", "commit", "discard", "release", "oob", "pending_err"]
    weights = [3, 4, 5, 3, 6, 2, 3, 1, 1]
    for _ in range(250):
        op = rng.choices(ops, weights)[0]
        if op in ("prefill", "decode", "tree"):
            choices = idle()
            rid = rng.choice(choices) if choices and (op == "decode" or rng.random() < 0.6) else new_rid()
            apply([make_entry(rid, op)])
        elif op == "batch":
            choices = idle()
            rids = rng.sample(choices, min(len(choices), rng.randint(1, 3)))
            if not rids or rng.random() < 0.4:
                rids.append(new_rid())
            apply([make_entry(rid, rng.choice(["prefill", "decode", "tree"])) for rid in rids])
        elif op == "commit" and pending:
            rid = rng.choice(list(pending))
            tokens, parents = pending.pop(rid)
            path = path_to(parents, rng.randrange(len(tokens)))
            runner.commit_tree(rid, path)
            seqs[rid].extend(tokens[i] for i in path)
            bump("commit")
            if rng.random() < 0.5:
                # Decode right after the commit: its logits see the moved KV rows of the path.
                apply([Chunk(rid, [rng.randrange(vocab)], [0])], force_verify=True)
        elif op == "discard" and pending:
            rid = rng.choice(list(pending))
            pending.pop(rid)
            runner.discard_tree(rid)
            bump("discard")
        elif op == "release" and seqs:
            rid = rng.choice(list(seqs))
            runner.release(rid)
            seqs.pop(rid)
            pending.pop(rid, None)
            before = state()
            with pytest.raises(UnknownRequest):
                runner.release(rid)
            with pytest.raises(UnknownRequest):
                runner.num_tokens(rid)
            assert not runner.has_request(rid)
            assert state() == before
            released.append(rid)
            bump("release")
        elif op == "oob":
            choices = idle()
            rids = rng.sample(choices, min(len(choices), rng.randint(0, 2))) + [new_rid()]
            entries = [make_entry(rid, rng.choice(["prefill", "decode", "tree"])) for rid in rids]
            # Pad the new request with enough tokens to exceed the free pool.
            too_many = (expected_free() + 1) * bs
            entries[-1] = Chunk(rids[-1], [rng.randrange(vocab) for _ in range(too_many)], [0])
            apply(entries)
        elif op == "pending_err" and pending:
            rid = rng.choice(list(pending))
            before = state()
            with pytest.raises(PendingTree):
                runner.forward([make_entry(rid, "decode")])
            assert state() == before
        check()

    assert stats.get("oob", 0) >= 10, stats
    assert stats.get("commit", 0) >= 20 and stats.get("verified", 0) >= 20, stats
    for rid in list(seqs):
        runner.release(rid)
        seqs.pop(rid)
        pending.pop(rid, None)
        check()
    assert runner.num_free_blocks == num_blocks
    assert runner.blocks.request_ids() == []
