"""The penalized target distribution: repetition, presence and frequency penalties, min_p and min_tokens.

`penalize` and `probabilities` against a straightforward reference (a loop over one sequence's tokens,
vLLM's formulas as its docs state them); along a tree, node i's row equals the row computed for the
sequence root..i alone, whatever its siblings hold; `TokenHistory` kept incrementally (and rebuilt
from a preempted request's context) equals one built from the whole sequence; and generation through
random draft trees gives exactly the tokens of plain sequential generation, greedy and seeded sampling,
with every penalty on.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from specserve.shared.spec.penalties import TokenHistory, penalize
from specserve.shared.spec.sampling import SamplingParams, probabilities
from specserve.shared.spec.token_tree import path_to
from specserve.shared.spec.tree_acceptance import accept_tree

V = 12
STOPS = (0, 5)
PENALTIES = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=-0.4),
    SamplingParams(temperature=0.8, repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=2.0),
    SamplingParams(temperature=1.0, min_tokens=3, stop_ids=STOPS, repetition_penalty=1.7, min_p=0.2),
]


def reference(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One next-token row after `prompt` + `output`, token by token as the docs state the rules."""
    x = [float(v) for v in row]
    counts = Counter(output)
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(output) < p.min_tokens:
        for t in p.stop_ids:
            x[t] = -math.inf
    return torch.tensor(x, dtype=torch.float32)


def history_of(prompt: list[int], output: list[int], p: SamplingParams) -> TokenHistory:
    h = TokenHistory(V, p)
    h.add_context(prompt)
    h.add_output(output)
    return h


def random_tree(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    tokens, parents = [rng.randrange(V)], [-1]
    for i in range(1, n):
        parents.append(rng.randrange(i))
        tokens.append(rng.randrange(V))
    return tokens, parents


@pytest.mark.parametrize("p", PENALTIES)
def test_a_row_equals_the_reference(p):
    rng = random.Random(1)
    for _ in range(50):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 6))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 6))]
        row = torch.randn(V, generator=torch.Generator().manual_seed(rng.randrange(10**6))) * 3
        got = penalize(row[None], [output[-1] if output else prompt[-1]], [-1], p, history_of(prompt, output, p))[0]
        torch.testing.assert_close(got, reference(row, prompt, output, p), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("p", PENALTIES)
def test_node_i_sees_its_own_path_and_no_sibling(p):
    """Every node's penalized row is bit for bit the row of the sequence committed + root..i alone."""
    rng = random.Random(2)
    for _ in range(40):
        prompt = [rng.randrange(V) for _ in range(4)]
        output = [rng.randrange(V) for _ in range(rng.randrange(1, 4))]
        tokens, parents = random_tree(rng, rng.randrange(1, 12))
        tokens[0] = output[-1]  # the root is the newest committed token
        logits = torch.randn(len(tokens), V) * 4
        rows = penalize(logits, tokens, parents, p, history_of(prompt, output, p))
        for i in range(len(tokens)):
            path = [tokens[j] for j in path_to(parents, i)[1:]]
            alone = penalize(logits[i:i + 1], [path[-1] if path else tokens[0]], [-1], p,
                             history_of(prompt, output + path, p))[0]
            assert torch.equal(rows[i], alone), (i, tokens, parents)


def test_min_tokens_holds_the_stop_ids_by_depth():
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_ids=STOPS)
    tokens, parents = [7, 1, 2, 3, 4], [-1, 0, 1, 2, 0]  # depths 0, 1, 2, 3, 1
    rows = penalize(torch.zeros(5, V), tokens, parents, p, history_of([9, 9], [7], p))  # 1 output token so far
    held = [bool(torch.isinf(rows[i, list(STOPS)]).all()) for i in range(5)]
    assert held == [True, True, False, False, True]  # their next token is output token 2, 3, 4, 5, 3
    assert torch.isfinite(rows[:, [1, 2, 3]]).all()
    assert torch.equal(penalize(torch.zeros(5, V), tokens, parents, p, history_of([9], [7, 1, 1], p)),
                       torch.zeros(5, V))  # min_tokens reached: nothing held


def test_min_p_drops_the_tokens_below_its_share_of_the_top():
    rng = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=rng) * 2
    for t, min_p in [(1.0, 0.1), (0.5, 0.3), (2.0, 0.05), (1.0, 1.0)]:
        got = probabilities(logits, SamplingParams(temperature=t, min_p=min_p))
        p = torch.softmax(logits.double() / t, -1)
        want = p.masked_fill(p < min_p * p.amax(-1, keepdim=True), 0)
        torch.testing.assert_close(got.double(), want / want.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)
    before_top_k = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.9, top_k=5))
    assert torch.equal(before_top_k, probabilities(logits, SamplingParams(temperature=1.0, min_p=0.9)))


def test_the_history_of_a_preempted_request_equals_the_one_it_had():
    """A preempted request's context is prompt + output but the newest; `num_prompt` tells them apart."""
    p = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2)
    prompt, output = [1, 2, 3, 2], [4, 4, 1, 7]
    resumed = TokenHistory(V, p, num_prompt=len(prompt))
    context = prompt + output[:-1]
    resumed.add_context(context[:3])  # in chunks
    resumed.add_context(context[3:])
    resumed.add_output(output[-1:])
    whole = history_of(prompt, output, p)
    assert resumed.num_output == whole.num_output == 4
    assert torch.equal(resumed.counts, whole.counts) and torch.equal(resumed.seen, whole.seen)
    assert TokenHistory(V, SamplingParams(min_tokens=2, stop_ids=(0,))).counts is None  # min_tokens counts nothing


# ---- generation through trees equals generation without ----------------------------------------------
TABLE = torch.randn(V, V, V, generator=torch.Generator().manual_seed(4)) * 2.5  # logits after (..., a, b)


def next_logits(seq: list[int]) -> torch.Tensor:
    return TABLE[seq[-2], seq[-1]]


def generate(prompt: list[int], p: SamplingParams, n: int, trees: random.Random | None) -> list[int]:
    """n tokens: one per step (trees None), or through random draft trees each holding some right guesses."""
    gen = p.make_generator()
    history, seq = history_of(prompt, [], p), list(prompt)
    token = accept_tree([seq[-1]], [-1], next_logits(seq)[None], p, gen, history).tokens[0]
    history.add_output([token])
    seq.append(token)
    while len(seq) - len(prompt) < n:
        tokens, parents = random_tree(trees, trees.randrange(1, 10)) if trees else ([0], [-1])
        tokens[0] = seq[-1]
        logits = torch.stack([next_logits(seq + [tokens[j] for j in path_to(parents, i)[1:]])
                              for i in range(len(tokens))])
        emitted = accept_tree(tokens, parents, logits, p, gen, history).tokens
        history.add_output(emitted)
        seq += emitted
    return seq[len(prompt):len(prompt) + n]


@pytest.mark.parametrize("p", [SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5,
                                              frequency_penalty=0.3, min_tokens=4, stop_ids=STOPS),
                               SamplingParams(temperature=0.9, seed=11, repetition_penalty=1.5, presence_penalty=0.5,
                                              frequency_penalty=0.3, min_p=0.05, min_tokens=4, stop_ids=STOPS)])
def test_tree_generation_equals_sequential_generation(p):
    plain = generate([3, 8, 1], p, 40, None)
    for seed in range(5):
        assert generate([3, 8, 1], p, 40, random.Random(seed)) == plain
    assert not set(plain[:4]) & set(STOPS)
    unpenalized = SamplingParams(temperature=p.temperature, seed=p.seed)
    assert generate([3, 8, 1], unpenalized, 40, None) != plain  # the penalties change the text


# ---- the target engine (in process, on the demo target) ------------------------------------------------
@pytest.fixture(scope="module")
def target():
    from specserve.target.config import TargetConfig
    from specserve.target.engine import TargetEngine

    return TargetEngine(TargetConfig(kv_blocks=64, threads=1))


def run(target, rid: str, context: list[int], spec, steps: int, guess: list[int] | None = None,
        resume: int | None = None) -> list[int]:
    """Prefill `context` in two chunks, then `steps` verify steps; a step's tree is the root alone, or with
    `guess`: a chain of the next two guessed tokens beside a wrong one-token branch under the root."""
    from specserve.shared.wire.messages import Forward, PrefillEntry, VerifyEntry

    half = len(context) // 2
    out: list[int] = []
    for step, (start, end) in enumerate([(0, half), (half, len(context))]):
        last = end == len(context)
        msg = Forward(prefill=[PrefillEntry(rid, step, start, end - start, last, spec if start == 0 else None,
                                            resume if last else None)])
        reply, payload = target.forward(msg, {"prefill_tokens": torch.tensor(context[start:end], dtype=torch.int32)})
        assert reply.results[0].error is None, reply.results[0].error
        out += payload["tokens"].tolist()
    for step in range(2, steps + 2):
        chain = (guess or [])[len(out):len(out) + 2]
        tokens = [out[-1], *chain] + ([(out[-1] + 1) % 4096] if guess else [])
        parents = [-1, *range(len(chain))] + ([0] if guess else [])
        msg = Forward(verify=[VerifyEntry(rid, step, len(context) + len(out), len(tokens))])
        reply, payload = target.forward(msg, {"tree_tokens": torch.tensor(tokens, dtype=torch.int32),
                                              "tree_parents": torch.tensor(parents, dtype=torch.int32)})
        assert reply.results[0].error is None, reply.results[0].error
        out += payload["tokens"].tolist()
    target.release(rid)
    return out


def test_the_target_keeps_the_history_through_chunks_trees_and_a_preemption(target):
    """Greedy with every penalty: verified through trees (right guesses beside a wrong branch) it equals
    root-only decoding; a preempted request rebuilt from prompt + output resumes it exactly; and the
    penalties change the output."""
    from specserve.shared.wire.messages import SamplingSpec

    prompt = [72, 400, 1201, 33, 9, 870, 15, 3001, 77, 260, 41, 72, 400]
    spec = SamplingSpec(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.5,
                        num_prompt=len(prompt))
    plain = run(target, "plain", prompt, spec, 24)
    assert run(target, "trees", prompt, spec, 24, guess=plain)[:len(plain)] == plain
    k = 9
    resumed = run(target, "resumed", prompt + plain[:k - 1], spec, 10, resume=plain[k - 1])
    assert resumed == plain[k - 1:k + 10]
    assert run(target, "unpenalized", prompt, SamplingSpec(temperature=0.0), 24) != plain


def test_min_tokens_holds_eos_back_at_the_target(target):
    """A prompt the demo target ends at once: EOS first, unless min_tokens holds it back that long."""
    from transformers import AutoTokenizer

    from specserve.shared.wire.messages import SamplingSpec
    from tests.support.gateway import PROMPTS, TARGET

    eos = [0, 4]
    prompt = AutoTokenizer.from_pretrained(TARGET)(PROMPTS[6])["input_ids"]
    assert run(target, "ends", prompt, SamplingSpec(temperature=0.0), 0)[0] in eos
    held = run(target, "held", prompt, SamplingSpec(temperature=0.0, min_tokens=4, eos_ids=eos,
                                                    num_prompt=len(prompt)), 3)
    assert not set(held[:4]) & set(eos), held
