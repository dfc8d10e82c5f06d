"""The EAGLE draft: a head over the target's features (services/draft/eagle_head.py, eagle.py, eagle_engine.py).

Here: the tests that start the whole stack; the others are in tests/unit/test_eagle.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.eagle import make_head
from tests.support.fixtures import start_up
from tests.support.gateway import PROMPTS, every_policy_is_lossless, greedy_results


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    make_head(out)
    return out


@pytest.fixture(scope="module")
def up_eagle(request, suite_profile, head_dir):
    return start_up(request, "--draft-model", str(head_dir), "--policy", "adaserve", profile=suite_profile)


def test_up_with_an_eagle_head_is_lossless_under_every_policy(up_eagle, reference):
    """`specserve up --draft-model <head>`: the target's features reach the head through the gateway, its
    trees are verified, and every policy gives transformers' greedy text."""

    results = asyncio.run(greedy_results(up_eagle.url, PROMPTS))
    assert [r.choices[0].text for r in results] == reference
    steps = [s for r in results for s in r.model_extra["specserve"]["steps"]]
    assert any(nodes > 1 for _, nodes, _ in steps), steps
    every_policy_is_lossless(up_eagle, reference)
