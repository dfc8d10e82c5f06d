"""The replay draft (services/draft/replay.py): chains of a recording's outputs, each token kept with
probability alpha, reproducibly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specserve.draft.config import DraftConfig
from specserve.draft.replay import Recording, ReplayDraftEngine

PROMPT = [5, 6, 7]
OUTPUT = list(range(20, 60))


def engine(tmp_path, alpha: float, seed: int = 0) -> ReplayDraftEngine:
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"alpha": alpha, "seed": seed,
                                "records": [{"prompt": [1, 2], "output": [3]}, {"prompt": PROMPT, "output": OUTPUT}]}))
    return ReplayDraftEngine(DraftConfig(model=f"replay:{path}"))


def test_alpha_one_proposes_the_recorded_continuation(tmp_path):
    eng = engine(tmp_path, 1.0)
    tree = eng._chain("r", PROMPT + OUTPUT[:5], depth=4)
    assert tree.tokens == [OUTPUT[4], *OUTPUT[5:9]] and tree.parents == [-1, 0, 1, 2, 3]
    assert tree.logp == [0.0] * 5
    assert eng._chain("r", PROMPT + OUTPUT[:38], depth=4).tokens == [OUTPUT[37], *OUTPUT[38:]]  # the record ends


def test_no_record_or_a_left_record_gives_a_root_only_tree(tmp_path):
    eng = engine(tmp_path, 1.0)
    assert eng._chain("a", [9, 9, 9, 9], depth=4).tokens == [9]
    assert eng._chain("b", PROMPT + [OUTPUT[0], 999], depth=4).tokens == [999]  # sampled off the record


def test_tokens_kept_at_rate_alpha_the_same_in_every_run(tmp_path):
    eng = engine(tmp_path, 0.6, seed=3)
    kept = Recording.load(tmp_path / "rec.json").kept(1, 20_000)
    assert abs(kept.mean() - 0.6) < 0.02
    assert np.array_equal(kept, Recording.load(tmp_path / "rec.json").kept(1, 20_000))
    tree = eng._chain("r", PROMPT + OUTPUT[:10], depth=6)
    want = [t if k else t - 1 for t, k in zip(OUTPUT[10:16], eng._kept[1][10:16])]
    assert tree.tokens[1:] == want and all(t != o for t, o, k in zip(tree.tokens[1:], OUTPUT[10:16],
                                                                        eng._kept[1][10:16]) if not k)
    assert tree.logp == pytest.approx([0.0] + [(k + 1) * np.log(0.6) for k in range(6)])


@pytest.mark.parametrize("alpha", [0, -0.1, 1.5])
def test_alpha_out_of_range_refused(tmp_path, alpha):
    with pytest.raises(ValueError, match="alpha"):
        engine(tmp_path, alpha)
