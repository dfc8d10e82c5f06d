"""ModelRunner batching: attention groups give the same logits as running entries alone, and a
failed pass gives back exactly the KV it took."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.shared.runtime.batch import Chunk, Tree, attention_groups, build_inputs
from specserve.shared.runtime.random_model import TINY_CONFIG, write_random_model
from specserve.shared.runtime.runner import ModelRunner, PendingTree

NUM_BLOCKS, BLOCK_SIZE = 128, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("batching") / "m", TINY_CONFIG, seed=5, std=0.1)


def test_attention_groups_bound_padding():
    assert attention_groups([1] * 6) == [[0, 1, 2, 3, 4, 5]]
    groups = attention_groups([128] + [1] * 100)
    assert len(groups) == 2 and sorted(i for g in groups for i in g) == list(range(101))
    assert groups[0] == [0, 1]  # the chunk takes one decode along; the rest share a group
    for lengths in ([40, 3, 1, 1, 9, 40, 2], [5] * 7, [64, 60, 3, 1], [200, 100, 50, 25, 1]):
        groups = attention_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            max_q = max(lengths[i] for i in g)
            assert max_q <= 8 or max_q * len(g) <= 2 * sum(lengths[i] for i in g)


def _setup(runner: ModelRunner, rng: random.Random, vocab: int) -> dict[str, list[int]]:
    contexts = {f"r{i}": [rng.randrange(vocab) for _ in range(rng.randint(3, 30))] for i in range(6)}
    runner.forward([Chunk(rid, toks) for rid, toks in contexts.items()])
    return contexts


def test_multi_group_batch_matches_entries_alone(model_dir):
    rng = random.Random(0)
    vocab = TINY_CONFIG["vocab_size"]
    batched = ModelRunner.from_dir(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    alone = ModelRunner.from_dir(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    contexts = _setup(batched, random.Random(1), vocab)
    assert _setup(alone, random.Random(1), vocab) == contexts
    entries = [
        Chunk("r0", [rng.randrange(vocab) for _ in range(40)], logits_at=list(range(40))),  # long chunk
        Chunk("r1", [rng.randrange(vocab)], logits_at=[0]),  # decode tokens
        Chunk("r2", [rng.randrange(vocab)], logits_at=[0]),
        Tree("r3", [rng.randrange(vocab) for _ in range(7)], [-1, 0, 0, 1, 1, 2, 5]),
        Chunk("r4", [rng.randrange(vocab) for _ in range(12)], logits_at=[11]),
        Chunk("new", [rng.randrange(vocab) for _ in range(25)], logits_at=[0, 24]),
    ]
    assert len(attention_groups([len(e.tokens) for e in entries])) > 1
    together = batched.forward(entries)
    for entry, logits in zip(entries, together):
        (single,) = alone.forward([entry])
        torch.testing.assert_close(logits, single, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits.argmax(-1), single.argmax(-1))


def test_failed_forward_gives_back_its_blocks(model_dir, monkeypatch):
    runner = ModelRunner.from_dir(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner.forward([Chunk("old", list(range(10)))])
    free = runner.num_free_blocks

    def boom(*args, **kwargs):
        raise RuntimeError("injected model failure")

    monkeypatch.setattr(runner, "model", boom)
    with pytest.raises(RuntimeError, match="injected"):
        runner.forward([Chunk("old", list(range(9))), Chunk("fresh", list(range(30)))])
    assert runner.num_free_blocks == free
    assert runner.num_tokens("old") == 10
    assert not runner.has_request("fresh")
    runner.blocks.check_invariants()


def test_discard_or_commit_without_a_tree_is_a_typed_error(model_dir):
    runner = ModelRunner.from_dir(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner.forward([Chunk("a", [1, 2, 3])])
    with pytest.raises(PendingTree):
        runner.discard_tree("a")
    with pytest.raises(PendingTree):
        runner.commit_tree("a", [0])
    runner.forward([Tree("a", [4, 5], [-1, 0])])
    with pytest.raises(PendingTree):
        runner.forward([Chunk("a", [6])])
    with pytest.raises(ValueError):
        runner.commit_tree("a", [1])
    runner.commit_tree("a", [0, 1])
    assert runner.num_tokens("a") == 5


@pytest.mark.parametrize(
    "bad_entry, error, message",
    [
        (Chunk("b", [1, 2, TINY_CONFIG["vocab_size"]]), ValueError, "outside the vocabulary"),
        (Chunk("b", [1, -1]), ValueError, "outside the vocabulary"),
        (Chunk("b", []), ValueError, "at least one token"),
        (Chunk("b", [1, 2], logits_at=[2]), ValueError, "logits_at"),
        (Tree("b", [1, 2, 3], [-1, 0, 2]), ValueError, "parents must precede"),
        (Tree("b", [1, 2], [0, 0]), ValueError, "root"),
        (Tree("b", [1, 2], [-1]), ValueError, "parent indices"),
        (Chunk("a", [3]), ValueError, "appears twice"),
    ],
)
def test_bad_entries_are_refused_without_touching_state(model_dir, bad_entry, error, message):
    """A bad entry anywhere in a batch fails the whole call before any KV is allocated."""
    runner = ModelRunner.from_dir(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner.forward([Chunk("a", [1, 2, 3, 4, 5])])
    free = runner.num_free_blocks
    with pytest.raises(error, match=message):
        runner.forward([Chunk("a", [6, 7]), bad_entry])
    assert runner.num_free_blocks == free
    assert runner.num_tokens("a") == 5
    assert not runner.has_request("b")
    # The runner keeps serving: the same request continues as if nothing happened.
    (logits,) = runner.forward([Chunk("a", [6], logits_at=[0])])
    assert logits.shape == (1, TINY_CONFIG["vocab_size"])


def test_lean_passes_have_no_mask_or_a_key_length_one(model_dir):
    """Masks only where a pass needs them: a lone decode or a lone first chunk has none (its keys
    cut to its length; the chunk is causal), decodes of several requests a [B, 1, 1, keys] one that
    ends each one's keys at its length, and a tree or a later chunk the full padded mask."""
    runner = ModelRunner.from_dir(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner.forward([Chunk("a", list(range(6))), Chunk("b", list(range(9)))])

    def group(entries, starts):
        runner.blocks.append_slots({e.request_id: len(e.tokens) for e in entries})
        try:
            inputs = build_inputs(entries, starts, runner.blocks, runner.windows, runner.device)
        finally:
            for e, s in zip(entries, starts):
                if s:
                    runner.blocks.truncate(e.request_id, s)
                else:
                    runner.blocks.free(e.request_id)
        (g,) = inputs.attention.groups
        return g, inputs

    lone, inputs = group([Tree("a", [3], [-1])], [6])
    assert (lone.masks, lone.kv_len, lone.causal) == ({}, 7, False)
    assert inputs.positions.tolist() == [6] and inputs.attention.slot_mapping.tolist() == [
        runner.blocks.block_table("a")[1] * BLOCK_SIZE + 2]
    first, _ = group([Chunk("c", [1, 2, 3])], [0])
    assert (first.masks, first.kv_len, first.causal) == ({}, 3, True)
    both, inputs = group([Chunk("a", [1], logits_at=[0]), Tree("b", [2], [-1])], [6, 9])
    (mask,) = both.masks.values()
    assert mask.shape == (2, 1, 1, 12) and not both.causal and both.kv_len is None
    assert mask[:, 0, 0].sum(-1).tolist() == [7, 10] and mask[0, 0, 0, :7].all() and mask[1, 0, 0, :10].all()
    assert inputs.positions.tolist() == [6, 9] and inputs.logits_indices.tolist() == [0, 1]
    tree, _ = group([Tree("a", [1, 2, 3], [-1, 0, 0])], [6])
    later, _ = group([Chunk("a", [1, 2])], [6])
    for g in (tree, later):
        (mask,) = g.masks.values()
        assert mask.shape[2] == g.max_q > 1 and g.kv_len is None and not g.causal
