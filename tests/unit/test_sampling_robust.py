"""The sampler cannot fail: no parameters SamplingParams accepts, and no logits without NaN, break it.

`probabilities` must give rows that are finite, non-negative, sum to 1 and keep a most likely
token, and `sample` must return a token of nonzero probability, for random logits with huge, tiny,
equal and infinite entries and any accepted temperature, top_p, top_k, min_p and seed (a property
test); the same after any accepted penalties (shared/spec/penalties.py) on any token history.
For ordinary values it must still be the distribution the original float32 formula gave
(`float32_reference` below is that formula, kept verbatim), with the same seeded draws.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.shared.spec.penalties import TokenHistory, penalize
from specserve.shared.spec.sampling import (
    SamplingParams,
    greedy_rows,
    greedy_tokens,
    probabilities,
    sample,
)

INF = float("inf")
# Values that used to break the sampler or sit at the edges of float32 / float64.
SPECIAL_LOGITS = [0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e308, -1e308, 1e30, -1e30, 1e-45, -1e-45, 1e-300, INF, -INF]
TINY = [5e-324, 1e-320, 1e-300, 1e-45, 1e-38, 1e-30, 1e-7]


def float32_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler as it was before it was made robust (float32, no shift before the division)."""
    logits = logits.detach().to("cpu", torch.float32)
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# ---- the property --------------------------------------------------------------------------------
@st.composite
def logit_batches(draw) -> torch.Tensor:
    rows, vocab = draw(st.integers(1, 4)), draw(st.integers(1, 24))
    value = st.one_of(st.floats(allow_nan=False), st.floats(allow_nan=False, width=32), st.sampled_from(SPECIAL_LOGITS))
    out = []
    for _ in range(rows):
        kind = draw(st.sampled_from(["mixed", "equal", "normal"]))
        if kind == "equal":
            out.append([draw(value)] * vocab)
        elif kind == "normal":
            scale = draw(st.sampled_from([1e-6, 1.0, 30.0, 1e6]))
            out.append([draw(st.floats(-4, 4)) * scale for _ in range(vocab)])
        else:
            out.append(draw(st.lists(value, min_size=vocab, max_size=vocab)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
    return torch.tensor(out, dtype=torch.float64).to(dtype)


accepted_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0, 2), st.sampled_from(TINY), st.floats(0, 1e308)),
    top_p=st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([*TINY, 1.0])),
    top_k=st.one_of(st.integers(-3, 30), st.sampled_from([2**31 - 1, 2**63, 10**30])),
    seed=st.integers(-(2**63), 2**64 - 1),
    min_p=st.one_of(st.just(0.0), st.floats(0, 1), st.sampled_from([*TINY, 1.0])),
)
penalized_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0, 2), st.sampled_from(TINY)),
    min_p=st.one_of(st.just(0.0), st.floats(0, 1)),
    repetition_penalty=st.one_of(st.floats(0, 2, exclude_min=True), st.sampled_from([*TINY, 1e30, 1e308])),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    min_tokens=st.integers(0, 3),
    stop_ids=st.lists(st.integers(-2, 30), max_size=3).map(tuple),
)


@settings(max_examples=1500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(logits=logit_batches(), params=accepted_params)
def test_probabilities_and_sample_are_total(logits, params):
    probs = probabilities(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all()), probs
    sums = probs.double().sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5), sums
    x = logits.double()
    for row, p in zip(x, probs):
        top = row == row.max()  # a most likely token (every token if the row is all -inf) keeps mass
        assert float(p[top].sum()) > 0, (row, p)
    generator = params.make_generator()
    for p in probs:
        token = sample(p, generator)
        assert 0 <= token < p.numel() and float(p[token]) > 0, (p, token)


@settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(logits=logit_batches(), params=penalized_params, data=st.data())
def test_penalized_probabilities_are_total(logits, params, data):
    vocab = logits.shape[-1]
    tokens = st.integers(0, vocab - 1)
    history = TokenHistory(vocab, params)
    history.add_context(data.draw(st.lists(tokens, min_size=1, max_size=6)))
    history.add_output(data.draw(st.lists(tokens, max_size=6)))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, len(logits))]
    tree = data.draw(st.lists(tokens, min_size=len(logits), max_size=len(logits)))
    x = penalize(logits, tree, parents, params, history)
    assert x.shape == logits.shape and not bool(torch.isnan(x).any()), x
    probs = probabilities(x, params)
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all()), probs
    sums = probs.double().sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5), sums


# ---- the values that used to fail ----------------------------------------------------------------
def test_values_that_broke_the_float32_sampler():
    logits = torch.tensor([[2.0, 5.0, 5.0 - 1e-3, -1.0, -INF], [0.5, 0.25, 0.125, 9.0, 1.0]])
    for params in (SamplingParams(temperature=1e-38), SamplingParams(temperature=5e-324),
                   SamplingParams(top_p=1e-300), SamplingParams(temperature=0.7, top_p=5e-324, top_k=10**30)):
        old = float32_reference(logits, params)
        assert not bool(torch.isfinite(old).all()), (params, old)  # the old formula made NaN here
        probs = probabilities(logits, params)
        # in the limit these are greedy: all mass on the argmax
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]], params
    # a tiny temperature over exact ties splits the mass between them
    tie = probabilities(torch.tensor([[1.0, 3.0, 3.0, -2.0]]), SamplingParams(temperature=1e-38))
    assert tie.tolist() == [[0.0, 0.5, 0.5, 0.0]]
    # +inf logits share the mass; a row of only -inf is uniform
    inf_rows = probabilities(torch.tensor([[INF, 0.0, INF, -INF], [-INF] * 4]), SamplingParams())
    assert inf_rows.tolist() == [[0.5, 0.0, 0.5, 0.0], [0.25] * 4]
    # a top_k beyond any vocabulary is no limit
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(probabilities(logits, SamplingParams(top_k=10**30)), probabilities(logits, SamplingParams()))


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1e-9), ("temperature", INF), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.0000001),
     ("top_p", math.nan), ("top_k", 1.5), ("seed", 2**64), ("seed", -(2**63) - 1), ("min_p", -1e-9),
     ("min_p", 1.0000001), ("min_p", math.nan), ("repetition_penalty", 0.0), ("repetition_penalty", INF),
     ("presence_penalty", math.nan), ("presence_penalty", 2.0000001), ("frequency_penalty", -INF),
     ("min_tokens", -1), ("stop_ids", (1.5,))],
)
def test_sampling_params_refuse_what_the_sampler_cannot_take(field, value):
    with pytest.raises(ValueError):
        SamplingParams(**{field: value})


# ---- ordinary values: the same distribution, the same seeded draws --------------------------------
def ordinary_cases(n: int):
    rng = random.Random(20261123)
    for _ in range(n):
        vocab = rng.choice([2, 7, 50, 300])
        scale = rng.choice([0.1, 1.0, 3.0, 20.0])
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        logits = torch.randn(rng.randint(1, 4), vocab, generator=gen) * scale
        params = SamplingParams(temperature=rng.uniform(0.05, 2.0),
                                top_p=rng.choice([1.0, rng.uniform(0.05, 1.0)]),
                                top_k=rng.choice([0, -1, rng.randint(1, vocab + 2)]),
                                seed=rng.randrange(2**32))
        yield logits, params


def test_ordinary_values_give_the_float32_formulas_distribution():
    worst = 0.0
    for logits, params in ordinary_cases(400):
        new, old = probabilities(logits, params), float32_reference(logits, params)
        assert bool(torch.isfinite(old).all())
        worst = max(worst, float((new - old).abs().max()))
        # the same support: the same top-k and nucleus cuts (float32 underflow aside)
        assert torch.equal(new > 1e-30, old > 1e-30), params
    assert worst < 1e-5, worst  # measured 1.5e-6: the float32 rounding of logits / temperature in the old formula


def test_ordinary_values_give_the_same_seeded_draws():
    draws = differing = 0
    for logits, params in ordinary_cases(200):
        new, old = probabilities(logits, params), float32_reference(logits, params)
        g_new, g_old = params.make_generator(), params.make_generator()
        for _ in range(25):
            for p_new, p_old in zip(new, old):
                draws += 1
                differing += sample(p_new, g_new) != int(torch.multinomial(p_old, 1, generator=g_old).item())
    assert draws > 10_000 and differing == 0, (differing, draws)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([*SPECIAL_LOGITS, math.nan, 2.0, 2.0]), min_size=1, max_size=9),
                min_size=1, max_size=5).filter(lambda rows: len({len(r) for r in rows}) == 1))
def test_greedy_tokens_are_torchs_argmax(rows):
    """NumPy's argmax on the CPU (greedy acceptance's) picks what torch's does: the first of equal largest
    values, a NaN over any number, the first NaN; other dtypes and devices go through torch."""
    logits = torch.tensor(rows, dtype=torch.float32)
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()
    assert greedy_tokens(logits.to(torch.float64)) == logits.to(torch.float64).argmax(-1).tolist()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=6), st.sampled_from([torch.float32, torch.float64]),
       st.integers(0, 2**31 - 1))
def test_greedy_rows_are_each_tensors_greedy_tokens(counts, dtype, seed):
    """One read back for a call's tensors (the torch path: float64 here, any dtype on a GPU) gives each
    tensor's rows what `greedy_tokens` gives them alone, ties and NaNs included."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-2, 3, (n, 7), generator=gen).to(dtype) for n in counts]
    for t in tensors[:1]:
        t[0, 3] = math.nan
    assert greedy_rows(tensors) == [greedy_tokens(t) for t in tensors]
    assert greedy_rows(tensors) == [t.argmax(-1).tolist() for t in tensors]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=8), st.data())
def test_greedy_rows_read_from_the_whole_pass_are_each_tensors_own(counts, data):
    """A pass's logits split by entry, some entries left out: read from the unsplit tensor's argmax (one call)
    where they hold at least half its rows, each tensor gets its own rows' argmax, ties included; the whole's
    argmax is what they are read from (a whole with other values gives other tokens)."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    logits = torch.randint(-2, 3, (sum(counts) + 2, 7), generator=gen).float()[1:-1]  # a view, offset 7
    split = list(torch.split(logits, counts))
    kept = [t for t in split if data.draw(st.booleans())]
    assert greedy_rows(kept, logits) == [t.argmax(-1).tolist() for t in kept]
    if 2 * sum(len(t) for t in kept) >= len(logits):
        other = torch.zeros(len(logits) + 2, 7)[1:-1]  # laid out as `logits`
        other[:, 6] = 1  # argmax 6 everywhere
        assert greedy_rows(kept, other) == [[6] * len(t) for t in kept]  # read from `whole`
