"""The n-gram draft (services/draft/ngram.py): trees from the request's own tokens.

Here: the tests that start the whole stack; the others are in tests/unit/test_ngram_draft.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fixtures import start_up
from tests.support.gateway import PROMPTS, every_policy_is_lossless, greedy_results


@pytest.fixture(scope="module")
def up_ngram(request, suite_profile):
    return start_up(request, "--draft-model", "ngram", "--policy", "adaserve", profile=suite_profile)


def test_up_with_the_ngram_draft_is_lossless_under_every_policy(up_ngram, reference):
    """`specserve up --draft-model ngram`: every policy gives transformers' greedy text, and the n-gram
    trees are verified and accepted (the demo prompts repeat themselves, as code does)."""

    results = asyncio.run(greedy_results(up_ngram.url, PROMPTS))  # adaserve, up's own policy
    assert [r.choices[0].text for r in results] == reference
    steps = [s for r in results for s in r.model_extra["specserve"]["steps"]]
    assert any(nodes > 1 for _, nodes, _ in steps) and any(acc > 0 for _, _, acc in steps), steps
    every_policy_is_lossless(up_ngram, reference)
