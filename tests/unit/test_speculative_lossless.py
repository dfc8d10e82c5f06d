"""Speculative decoding with random token trees reproduces target-only decoding exactly.

Greedy: token for token. Seeded sampling: also token for token, because tree acceptance draws
each emitted token from the target's own distribution with the request's generator, exactly as
target-only sampling does (one draw per emitted token, in the same order).
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.generate import generate
from specserve.shared.runtime.random_model import TINY_CONFIG, write_random_model
from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.spec.sampling import SamplingParams
from specserve.shared.spec.tree_acceptance import accept_tree

NUM_BLOCKS, BLOCK_SIZE = 96, 4
PROMPT_LENGTHS = {"short": 3, "mid": 17, "long": 41, "odd": 9}
MAX_NEW = 28


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # std 0.1 makes next-token distributions peaked enough that argmax gaps dwarf float noise.
    return write_random_model(tmp_path_factory.mktemp("spec") / "m", TINY_CONFIG, seed=3, std=0.1)


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner.from_dir(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


def _prompts(vocab: int) -> dict[str, list[int]]:
    rng = random.Random(11)
    return {rid: [rng.randrange(vocab) for _ in range(n)] for rid, n in PROMPT_LENGTHS.items()}


def _random_tree(rng: random.Random, root: int, oracle: list[int], vocab: int) -> tuple[list[int], list[int]]:
    """A random tree whose nodes sometimes follow `oracle` (the continuation a good draft would
    guess) and otherwise hold random tokens. Siblings carry distinct tokens."""
    tokens, parents, on_oracle, depth = [root], [-1], [True], [0]
    max_nodes = rng.randint(1, 14)
    frontier = [0]
    while frontier and len(tokens) < max_nodes:
        node = frontier.pop(0)
        if depth[node] >= 6:
            continue
        used: set[int] = set()
        for _ in range(rng.randint(0, 3)):
            d = depth[node]
            if on_oracle[node] and d < len(oracle) and rng.random() < 0.7 and oracle[d] not in used:
                tok, good = oracle[d], True
            else:
                tok, good = rng.randrange(vocab), False
                if tok in used:
                    continue
                good = on_oracle[node] and d < len(oracle) and tok == oracle[d]
            used.add(tok)
            tokens.append(tok)
            parents.append(node)
            on_oracle.append(good)
            depth.append(depth[node] + 1)
            frontier.append(len(tokens) - 1)
            if len(tokens) >= max_nodes:
                break
    return tokens, parents


def _speculative(runner, prompts, params, reference, seed, prefill_chunk=8):
    """Chunked prefill and tree verification mixed in the same passes, until MAX_NEW tokens."""
    rng = random.Random(seed)
    vocab = runner.config.vocab_size
    gens = {rid: params.make_generator() for rid in prompts}
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    to_prefill = {rid: list(p) for rid, p in prompts.items()}
    accepted_drafts = 0
    while any(len(o) < MAX_NEW for o in out.values()):
        entries = []
        for rid in prompts:
            if to_prefill[rid]:
                chunk, to_prefill[rid] = to_prefill[rid][:prefill_chunk], to_prefill[rid][prefill_chunk:]
                entries.append(Chunk(rid, chunk, logits_at=[] if to_prefill[rid] else [len(chunk) - 1]))
            elif len(out[rid]) < MAX_NEW:
                done = len(out[rid])
                oracle = reference[rid][done:]
                entries.append(Tree(rid, *_random_tree(rng, out[rid][-1], oracle, vocab)))
        for entry, logits in zip(entries, runner.forward(entries)):
            rid = entry.request_id
            if isinstance(entry, Chunk):
                if len(logits):  # last prefill chunk: its logits give the first token
                    acc = accept_tree([entry.tokens[-1]], [-1], logits, params, gens[rid])
                    out[rid].extend(acc.tokens)
                continue
            acc = accept_tree(entry.tokens, entry.parents, logits, params, gens[rid])
            runner.commit_tree(rid, acc.path)
            accepted_drafts += acc.num_accepted_drafts
            out[rid].extend(acc.tokens)
    for rid in prompts:
        runner.release(rid)
    return {rid: o[:MAX_NEW] for rid, o in out.items()}, accepted_drafts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_trees_match_target_only(runner, seed):
    prompts = _prompts(runner.config.vocab_size)
    reference = generate(runner, prompts, MAX_NEW)
    assert runner.num_free_blocks == NUM_BLOCKS
    spec, accepted = _speculative(runner, prompts, SamplingParams(temperature=0.0), reference, seed)
    assert spec == reference
    assert accepted > 20, "trees should have accepted drafts; otherwise the test proves little"
    assert runner.num_free_blocks == NUM_BLOCKS


def test_greedy_reference_is_not_degenerate(runner):
    prompts = _prompts(runner.config.vocab_size)
    reference = generate(runner, prompts, MAX_NEW)
    for rid, toks in reference.items():
        assert len(set(toks)) > 3, f"{rid}: greedy output {toks} repeats; trees would be trivial"


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8, top_k=50, seed=7), SamplingParams(temperature=1.0, top_p=0.9, seed=8)],
)
def test_seeded_sampling_trees_match_target_only(runner, params):
    prompts = _prompts(runner.config.vocab_size)
    # One generator per request in both runs, seeded alike: the token sequences must coincide.
    reference = {rid: generate(runner, {rid: p}, MAX_NEW, params=params)[rid] for rid, p in prompts.items()}
    spec, accepted = _speculative(runner, prompts, params, reference, seed=5)
    assert spec == reference
    assert accepted > 10
    assert runner.num_free_blocks == NUM_BLOCKS


def test_wrong_commit_would_change_output(runner):
    """Control: committing the wrong KV rows (skip the copy) must break exactness."""
    prompts = _prompts(runner.config.vocab_size)
    reference = generate(runner, prompts, MAX_NEW)
    original = runner.kv.move_slots
    runner.kv.move_slots = lambda src, dst: None
    try:
        spec, _ = _speculative(runner, prompts, SamplingParams(temperature=0.0), reference, seed=0)
    finally:
        runner.kv.move_slots = original
    assert spec != reference
    torch.testing.assert_close(torch.tensor(runner.num_free_blocks), torch.tensor(NUM_BLOCKS))
