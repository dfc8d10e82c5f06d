"""Tree acceptance is lossless: speculative sampling through draft trees reproduces the target.

A synthetic target over a small vocabulary has a fixed next-token logit table conditioned on the
last two tokens. A "speculative generator" repeatedly drafts a random token tree (random shape,
likely and unlikely tokens), computes the target logits of every node from its path, calls
`accept_tree`, and appends the emitted tokens. The empirical distribution of the first L tokens
must match the exact target distribution (enumerated over V^L sequences) under a chi-square
goodness-of-fit test; deliberately biased acceptance rules must fail the same test.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import pytest
import torch

from specserve.shared.spec.sampling import SamplingParams, probabilities, sample
from specserve.shared.spec.token_tree import children_by_token
from specserve.shared.spec.tree_acceptance import Acceptance, accept_tree, walk

V = 6  # vocabulary
L = 3  # continuation length whose joint distribution is tested
PREFIX = (3, 5)  # the context before the continuation; its last token is the first tree root
N_TRIALS = 8_000
N_TRIALS_NEGATIVE = 5_000  # a biased rule must be rejected even with fewer samples
Z_1E4 = 3.719016  # upper 1e-4 quantile of the standard normal


def logit_table(seed: int = 1234) -> torch.Tensor:
    """[V, V, V]: table[a, b] are the next-token logits after tokens (..., a, b)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, V, generator=gen) * 2.0


TABLE = logit_table()

PARAMS = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7_topk3": SamplingParams(temperature=0.7, top_k=3),
    "t1.3_topp0.8": SamplingParams(temperature=1.3, top_p=0.8),
}


def prob_table(params: SamplingParams) -> torch.Tensor:
    return probabilities(TABLE.reshape(V * V, V), params).reshape(V, V, V).double()


def exact_distribution(params: SamplingParams) -> torch.Tensor:
    """[V**L] target probability of every L-token continuation of PREFIX (index base V)."""
    p = prob_table(params)
    a, b = PREFIX
    joint = p[a, b][:, None, None] * p[b][:, :, None] * p  # p(x1|a,b) p(x2|b,x1) p(x3|x1,x2)
    assert L == 3
    joint = joint.reshape(-1)
    assert abs(float(joint.sum()) - 1.0) < 1e-5
    return joint / joint.sum()


# ---- chi-square goodness of fit ----------------------------------------------------------


def chi_square_critical(dof: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the upper quantile of chi-square(dof)."""
    k = float(dof)
    return k * (1.0 - 2.0 / (9.0 * k) + z * math.sqrt(2.0 / (9.0 * k))) ** 3


def chi_square_fit(counts: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> dict:
    """Goodness of fit of integer counts to a distribution; rejects at p < 1e-4.

    Cells with zero target probability must stay empty (any hit rejects outright). Cells with
    expected count below `min_expected` are pooled into one bin.
    """
    counts = counts.double()
    n = float(counts.sum())
    expected = expected_probs.double() * n
    impossible = int(counts[expected_probs == 0].sum())
    big = expected >= min_expected
    obs_bins = counts[big].tolist()
    exp_bins = expected[big].tolist()
    small = (~big) & (expected_probs > 0)
    if small.any():
        obs_bins.append(float(counts[small].sum()))
        exp_bins.append(float(expected[small].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_bins, exp_bins))
    dof = len(obs_bins) - 1
    crit = chi_square_critical(dof)
    return {
        "stat": stat,
        "dof": dof,
        "critical": crit,
        "impossible_hits": impossible,
        "rejected": impossible > 0 or stat > crit,
    }


def test_wilson_hilferty_matches_known_quantiles() -> None:
    # Exact upper-1e-4 quantiles of chi-square(k) (computed with mpmath from the incomplete gamma).
    for dof, exact in [(10, 35.5640), (50, 95.9687), (100, 161.3187), (200, 283.0603)]:
        assert chi_square_critical(dof) == pytest.approx(exact, rel=0.015)


# ---- the speculative generator -------------------------------------------------------------

AcceptFn = Callable[[Sequence[int], Sequence[int], torch.Tensor, SamplingParams, torch.Generator], Acceptance]


class DraftTrees:
    """Random draft trees rooted at the last token: random depth and width, distinct siblings.

    Children are chosen per tree or per node as the target's likeliest tokens, uniformly at
    random, or as its least likely tokens (often impossible under top-k / top-p).
    """

    def __init__(self, rng: random.Random, params: SamplingParams, max_nodes: int = 16):
        self.rng = rng
        self.max_nodes = max_nodes
        p = prob_table(params)
        # Per context (a, b): tokens from the target's likeliest to its least likely.
        self.order = p.argsort(dim=-1, descending=True, stable=True).tolist()

    def children(self, a: int, b: int, width: int, mode: str) -> list[int]:
        rng = self.rng
        if mode == "mixed":
            mode = rng.choice(["likely", "random", "unlikely"])
        order = self.order[a][b]
        if mode == "likely":
            start = rng.choice([0, 0, 0, 1])
            return order[start : start + width]
        if mode == "unlikely":
            return order[::-1][:width]
        return rng.sample(range(V), width)

    def build(self, a: int, b: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """Tree rooted at token b (preceded by a): tokens, parents, and each node's (a, b) context."""
        rng = self.rng
        max_depth = rng.choice([0, 1, 2, 2, 3, 3, 4])
        mode = rng.choice(["likely", "likely", "likely", "likely", "random", "unlikely", "mixed"])
        tokens, parents, ctx_a, ctx_b, depth = [b], [-1], [a], [b], [0]
        i = 0
        while i < len(tokens):
            if depth[i] < max_depth:
                width = rng.choice([0, 1, 2, 2, 3])
                for t in self.children(ctx_a[i], ctx_b[i], width, mode):
                    if len(tokens) >= self.max_nodes:
                        break
                    tokens.append(t)
                    parents.append(i)
                    ctx_a.append(ctx_b[i])
                    ctx_b.append(t)
                    depth.append(depth[i] + 1)
            i += 1
        return tokens, parents, ctx_a, ctx_b


def speculative_counts(
    params: SamplingParams, accept: AcceptFn, n_trials: int, seed: int
) -> tuple[torch.Tensor, dict]:
    """Counts over the V**L first-L-token continuations, and how the trees fared."""
    rng = random.Random(seed)
    drafts = DraftTrees(rng, params)
    calls = accepted_calls = 0
    hist = [0] * (V**L)
    for trial in range(n_trials):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + trial)
        out: list[int] = []
        a, b = PREFIX
        while len(out) < L:
            tokens, parents, ctx_a, ctx_b = drafts.build(a, b)
            logits = TABLE[ctx_a, ctx_b]  # [n_nodes, V]: the target's logits at every node
            result = accept(tokens, parents, logits, params, gen)
            calls += 1
            accepted_calls += len(result.path) > 1
            # The accepted path really is a root-to-node path whose tokens were emitted.
            assert result.path[0] == 0 and len(result.tokens) == len(result.path)
            for prev, node in zip(result.path, result.path[1:]):
                assert parents[node] == prev
            assert [tokens[n] for n in result.path[1:]] == result.tokens[:-1]
            out.extend(result.tokens)
            seq = [a, b] + result.tokens
            a, b = seq[-2], seq[-1]
        hist[(out[0] * V + out[1]) * V + out[2]] += 1
    return torch.tensor(hist), {"calls": calls, "calls_accepting_drafts": accepted_calls}


# ---- biased acceptance rules (negative controls) -----------------------------------------


def accept_first_child(tokens, parents, logits, params, generator) -> Acceptance:
    """Wrong: follows the first child without checking the target (greedy on the draft)."""
    children = [[i for i in range(len(tokens)) if parents[i] == node] for node in range(len(tokens))]
    probs = probabilities(logits, params)
    path, emitted, node = [0], [], 0
    while children[node]:
        node = children[node][0]
        path.append(node)
        emitted.append(tokens[node])
    emitted.append(sample(probs[node], generator))
    return Acceptance(path, emitted)


def accept_redraw_on_miss(tokens, parents, logits, params, generator) -> Acceptance:
    """Wrong: when the draw misses every child, it emits a fresh draw instead of the first one."""
    children = children_by_token(tokens, parents)
    probs = probabilities(logits, params)
    path, emitted, node = [0], [], 0
    while True:
        token = sample(probs[node], generator)
        child = children[node].get(token)
        if child is None:
            emitted.append(sample(probs[node], generator))
            return Acceptance(path, emitted)
        emitted.append(token)
        path.append(child)
        node = child


def accept_parent_logits(tokens, parents, logits, params, generator) -> Acceptance:
    """Wrong: off-by-one logits row; a non-root node draws from its parent's distribution."""
    children = children_by_token(tokens, parents)
    probs = probabilities(logits, params)
    return walk(children, lambda node: sample(probs[max(parents[node], 0)], generator))


# ---- the statistical tests -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(PARAMS))
def test_tree_sampling_matches_target_distribution(name: str) -> None:
    params = PARAMS[name]
    expected = exact_distribution(params)
    counts, stats = speculative_counts(params, accept_tree, N_TRIALS, seed=7)
    assert int(counts.sum()) == N_TRIALS
    # Trees must accept drafts often (else this only tests plain sampling), and miss often too.
    assert 0.25 < stats["calls_accepting_drafts"] / stats["calls"] < 0.8, stats
    fit = chi_square_fit(counts, expected)
    assert fit["dof"] >= 10, fit
    assert not fit["rejected"], fit


@pytest.mark.parametrize(
    "accept", [accept_first_child, accept_redraw_on_miss, accept_parent_logits], ids=lambda f: f.__name__
)
def test_biased_acceptance_is_rejected(accept: AcceptFn) -> None:
    params = PARAMS["t1.0"]  # full support: rejection must come from the statistic itself
    expected = exact_distribution(params)
    counts, _ = speculative_counts(params, accept, N_TRIALS_NEGATIVE, seed=11)
    fit = chi_square_fit(counts, expected)
    assert fit["impossible_hits"] == 0
    assert fit["rejected"] and fit["stat"] > fit["critical"], fit


def test_plain_sampling_passes_the_same_check() -> None:
    """Control for the control: exact samples from the target pass at the negative tests' size."""
    params = PARAMS["t1.0"]
    expected = exact_distribution(params)
    gen = torch.Generator().manual_seed(5)
    idx = torch.multinomial(expected.float(), N_TRIALS_NEGATIVE, replacement=True, generator=gen)
    counts = torch.bincount(idx, minlength=V**L)
    assert not chi_square_fit(counts, expected)["rejected"]


def speculative_stream(drafts: DraftTrees, params: SamplingParams, gen: torch.Generator, length: int) -> list[int]:
    """At least `length` tokens from PREFIX on, each step verifying a fresh random draft tree."""
    a, b = PREFIX
    out: list[int] = []
    while len(out) < length:
        tokens, parents, ctx_a, ctx_b = drafts.build(a, b)
        out += accept_tree(tokens, parents, TABLE[ctx_a, ctx_b], params, gen).tokens
        a, b = ([a, b] + out)[-2:]
    return out


# ---- greedy acceptance --------------------------------------------------------------------


def one_hot_logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    for i, t in enumerate(argmaxes):
        logits[i, t] = 5.0
    return logits


GREEDY = SamplingParams(temperature=0.0)
#        node:   0   1   2   3   4   5
TREE_TOKENS = [7, 1, 2, 3, 4, 5]
TREE_PARENTS = [-1, 0, 0, 1, 1, 3]  # 0 -> {1: tok 1, 2: tok 2}; 1 -> {3: tok 3, 4: tok 4}; 3 -> {5: tok 5}


@pytest.mark.parametrize(
    "argmaxes, path, emitted",
    [
        # full match down to the leaf node 5, then the target's own token after it
        ([1, 3, 0, 5, 0, 6], [0, 1, 3, 5], [1, 3, 5, 6]),
        # partial match: root -> node 1, then the target wants 6 which is no child of node 1
        ([1, 6, 0, 0, 0, 0], [0, 1], [1, 6]),
        # match into the other branch: root -> node 2 (a leaf)
        ([2, 0, 0, 0, 0, 0], [0, 2], [2, 0]),
        # match through node 4 (leaf of branch 1)
        ([1, 4, 0, 0, 2, 0], [0, 1, 4], [1, 4, 2]),
        # root-only miss: the target's first token is no child of the root
        ([6, 3, 0, 5, 0, 6], [0], [6]),
    ],
)
def test_greedy_acceptance(argmaxes, path, emitted) -> None:
    result = accept_tree(TREE_TOKENS, TREE_PARENTS, one_hot_logits(argmaxes), GREEDY)
    assert result.path == path
    assert result.tokens == emitted
    assert result.num_accepted_drafts == len(path) - 1


def test_greedy_root_only_tree_and_duplicate_siblings() -> None:
    result = accept_tree([4], [-1], one_hot_logits([2]), GREEDY)
    assert (result.path, result.tokens) == ([0], [2])
    # Duplicate sibling tokens: the first child wins.
    result = accept_tree([0, 3, 3], [-1, 0, 0], one_hot_logits([3, 1, 2]), GREEDY)
    assert (result.path, result.tokens) == ([0, 1], [3, 1])


def test_greedy_ignores_generator_and_matches_argmax_decoding() -> None:
    """Greedy through random trees equals plain argmax decoding token for token."""
    rng = random.Random(3)
    drafts = DraftTrees(rng, GREEDY)
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    spec = speculative_stream(drafts, GREEDY, gen, 40)
    assert torch.equal(gen.get_state(), state)  # greedy draws nothing from the generator
    a, b = PREFIX
    plain: list[int] = []
    for _ in range(len(spec)):
        t = int(TABLE[a, b].argmax())
        plain.append(t)
        a, b = b, t
    assert spec == plain


# ---- seeded determinism ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PARAMS))
def test_same_seed_same_tokens(name: str) -> None:
    params = PARAMS[name]
    logits = TABLE[[1, 3, 3, 2], [3, 2, 4, 0]] * 0.3  # soft, so several outcomes are likely
    tokens, parents = [3, 2, 4, 0], [-1, 0, 0, 1]
    outcomes = set()
    for seed in range(30):
        first = accept_tree(tokens, parents, logits, params, torch.Generator().manual_seed(seed))
        again = accept_tree(tokens, parents, logits, params, torch.Generator().manual_seed(seed))
        assert (first.path, first.tokens) == (again.path, again.tokens)
        outcomes.add(tuple(first.tokens))
    assert len(outcomes) > 1  # the seed matters


@pytest.mark.parametrize("name", list(PARAMS))
def test_root_only_tree_equals_plain_sampling(name: str) -> None:
    params = PARAMS[name]
    for seed in range(50):
        logits = TABLE[seed % V, (seed // V) % V][None]
        result = accept_tree([seed % V], [-1], logits, params, torch.Generator().manual_seed(seed))
        plain = sample(probabilities(logits, params)[0], torch.Generator().manual_seed(seed))
        assert result.path == [0]
        assert result.tokens == [plain]


@pytest.mark.parametrize("name", list(PARAMS))
def test_seeded_tree_sampling_equals_plain_sampling_token_for_token(name: str) -> None:
    """Each emitted token is the target's own seeded draw, so any tree shape gives the same stream."""
    params = PARAMS[name]
    for seed in range(20):
        rng = random.Random(seed)
        drafts = DraftTrees(rng, params)
        gen = torch.Generator().manual_seed(seed)
        spec = speculative_stream(drafts, params, gen, 30)
        gen = torch.Generator().manual_seed(seed)
        a, b = PREFIX
        plain: list[int] = []
        for _ in range(len(spec)):
            t = sample(probabilities(TABLE[a, b][None], params)[0], gen)
            plain.append(t)
            a, b = b, t
        assert spec == plain, seed
