"""The draft's beam search, in process: DraftNodes passes see exactly what a one-shot tree sees, and
the batched, incremental beam search finds the same trees as the one-shot reference search."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.draft.beam import BeamRequest, BeamTree, _extend_chains, _select, beam_search
from specserve.draft.static_step import StaticBeamStep, bucket
from specserve.shared.runtime.batch import Chunk, DraftNodes, Tree
from specserve.shared.runtime.random_model import TINY_CONFIG, write_random_model
from specserve.shared.runtime.runner import ModelRunner, PendingTree
from training.evaluate import _beam_tree

NUM_BLOCKS, BLOCK_SIZE = 128, 4
VOCAB = TINY_CONFIG["vocab_size"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("beam") / "m", TINY_CONFIG, seed=7, std=0.1)


def _runner(model_dir, kernels: str = "auto") -> ModelRunner:
    return ModelRunner.from_dir(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kernels=kernels)


def test_draft_nodes_over_passes_equal_one_tree(model_dir):
    """Root r with children a, b and grandchild c under a: the forest, grown in two passes over a
    committed r, gives every node the logits the one-shot Tree gives it."""
    rng = random.Random(3)
    context = [rng.randrange(VOCAB) for _ in range(13)]
    r, a, b, c, e = (rng.randrange(VOCAB) for _ in range(5))
    one_shot = _runner(model_dir)
    one_shot.forward([Chunk("x", context)])
    (tree_logits,) = one_shot.forward([Tree("x", [r, a, b, c, e], [-1, 0, 0, 1, 2])])

    grown = _runner(model_dir)
    grown.forward([Chunk("x", context + [r])])
    (layer1,) = grown.forward([DraftNodes("x", [a, b], [-1, -1])])
    (layer2,) = grown.forward([DraftNodes("x", [c, e], [0, 1])])
    torch.testing.assert_close(layer1, tree_logits[1:3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer2, tree_logits[3:5], rtol=1e-5, atol=1e-5)
    with pytest.raises(PendingTree, match="can only be discarded"):
        grown.commit_tree("x", [0])
    with pytest.raises(PendingTree):
        grown.forward([Chunk("x", [a])])
    grown.discard_tree("x")
    assert grown.num_tokens("x") == len(context) + 1 and not grown.has_pending("x")


def test_draft_nodes_refuse_a_parent_not_yet_run(model_dir):
    runner = _runner(model_dir)
    runner.forward([Chunk("x", [1, 2, 3])])
    with pytest.raises(ValueError, match="parents must be -1 or an earlier node"):
        runner.forward([DraftNodes("x", [4, 5], [-1, 2])])
    assert runner.num_tokens("x") == 3 and not runner.has_pending("x")


@pytest.mark.parametrize("depth,width", [(1, 1), (3, 1), (3, 2), (4, 3)])
def test_batched_beam_search_matches_the_reference_search(model_dir, depth, width):
    """Three requests searched together (with different shapes) give the trees that the one-shot
    reference (training/evaluate.py, which re-runs the whole tree every step) finds alone."""
    rng = random.Random(depth * 10 + width)
    contexts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(2, 20))] for i in range(3)}
    shapes = {"r0": (depth, width), "r1": (max(depth - 1, 1), width), "r2": (depth, max(width - 1, 1))}
    runner = _runner(model_dir)
    logits = runner.forward([Chunk(rid, toks, logits_at=[len(toks) - 1]) for rid, toks in contexts.items()])
    requests = [BeamRequest(rid, toks[-1], lg[0], *shapes[rid]) for (rid, toks), lg in zip(contexts.items(), logits)]
    trees, forwards = beam_search(runner, requests)
    assert forwards == depth - 1
    reference_runner = _runner(model_dir)
    for rid, toks in contexts.items():
        assert runner.num_tokens(rid) == len(toks) and not runner.has_pending(rid)  # beam nodes discarded
        reference_runner.forward([Chunk(rid, toks[:-1])])
        d, w = shapes[rid]
        ref_tokens, ref_parents = _beam_tree(reference_runner, [rid], {rid: toks[-1]}, d, w)[rid]
        assert trees[rid].tokens == ref_tokens and trees[rid].parents == ref_parents
        assert len(trees[rid].tokens) == 1 + d * w
        probs = torch.tensor(trees[rid].logp).exp()
        # A path probability never exceeds its parent's.
        for node, parent in enumerate(trees[rid].parents[1:], start=1):
            assert probs[node] <= probs[parent] + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chains_extended_together_are_each_chain_extended_alone(dtype):
    """Width-1 steps of several chains at once (one argmax and read back for all) append the node, parent
    and path log-probability `_select` appends for each alone, ties and a NaN row included; float64 takes
    the torch path a GPU takes."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(-3, 1, (5, 11), generator=gen).to(dtype).float()
    rows[2, 4] = float("nan")

    def start(i: int) -> BeamTree:
        return BeamTree([7, 1 + i], [-1, 0], [0.0, -0.25 * i], [1])

    together = [start(i) for i in range(5)]
    _extend_chains(together, rows.to(dtype))
    for i, tree in enumerate(together):
        alone = start(i)
        _select(alone, torch.tensor([alone.logp[j] for j in alone.layer]), rows[i:i + 1].to(dtype), 1)
        assert (tree.tokens, tree.parents, tree.layer) == (alone.tokens, alone.parents, alone.layer)
        assert tree.logp[:2] == alone.logp[:2]
        assert tree.logp[2] == alone.logp[2] or (tree.logp[2] != tree.logp[2] and alone.logp[2] != alone.logp[2])


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_static_shape_beam_steps_equal_the_dynamic_ones(model_dir):
    """The padding the CUDA-graph path uses (requests and KV blocks to power-of-two buckets, run here
    eagerly on CPU through the torch pass, which the graphs capture) changes no real row: same trees, same
    logits, and buckets are reused."""
    rng = random.Random(21)
    contexts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(2, 30))] for i in range(5)}
    results = []
    for static in (False, True):
        runner = _runner(model_dir, kernels="torch")
        step = StaticBeamStep(runner, use_graphs=False) if static else None
        logits = runner.forward([Chunk(rid, toks, logits_at=[len(toks) - 1]) for rid, toks in contexts.items()])
        requests = [BeamRequest(rid, toks[-1], lg[0], 4, 3) for (rid, toks), lg in zip(contexts.items(), logits)]
        trees, _ = beam_search(runner, requests, step)
        results.append(trees)
        if static:
            assert step.statics and set(step.statics) <= {(8, 3, 8), (8, 3, 16)}  # 5 requests -> 8 (per KV size)
            assert runner.num_free_blocks == NUM_BLOCKS - 1 - sum(-(-len(t) // BLOCK_SIZE) for t in contexts.values())
    dynamic, static = results
    for rid in contexts:
        assert static[rid].tokens == dynamic[rid].tokens and static[rid].parents == dynamic[rid].parents
        assert static[rid].logp == pytest.approx(dynamic[rid].logp, abs=1e-4)


def test_the_drafts_reply_says_when_a_beam_step_captured_a_cuda_graph(monkeypatch):
    """The draft flags a Speculate call in which a beam step captured a graph (`SpeculateReply.warmup`, which the
    gateway's cost model skips). Capture needs a GPU: here the static steps run eagerly and a new bucket counts
    as a capture, as on CUDA."""
    from specserve.draft.config import DraftConfig
    from specserve.draft.engine import DraftEngine
    from specserve.shared.wire.messages import Speculate, SpeculateEntry

    engine = DraftEngine(DraftConfig(kv_blocks=64, threads=1, kernels="torch"))
    step = engine.static_step = StaticBeamStep(engine.runner, use_graphs=False)
    run = step.run_model

    def run_counting(model, kv, inputs):
        known = len(step.statics)
        out = run(model, kv, inputs)
        step.captures += len(step.statics) > known  # a new bucket: on CUDA, its graph is captured here
        return out

    monkeypatch.setattr(step, "run_model", run_counting)

    def speculate(rid: str, step_no: int, new: list[int], committed: int):
        reply, _ = engine.speculate(Speculate([SpeculateEntry(rid, step_no, len(new), committed, 3, 2)]),
                                    {"tokens": torch.tensor(new, dtype=torch.int32)})
        assert all(t.error is None and t.num_nodes > 1 for t in reply.trees)
        return reply

    assert speculate("a", 1, [5, 6, 7, 8], 4).warmup and step.captures > 0
    seen = step.captures
    assert not speculate("b", 1, [9, 10, 11, 12], 4).warmup and step.captures == seen  # the same buckets: replayed
