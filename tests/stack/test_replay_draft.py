"""The replay draft served by `specserve up`: greedy output unchanged, and every verify step accepts
exactly the recorded tokens its chain kept (the acceptance a benchmark sets is the one it gets)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from specserve.draft.replay import Recording, record_greedy
from tests.support.fixtures import start_up
from tests.support.gateway import PROMPTS, TARGET, client, wait_all_free

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def recorded(request, tmp_path_factory, suite_profile):
    tok = AutoTokenizer.from_pretrained(TARGET)
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    path = tmp_path_factory.mktemp("replay") / "rec.json"
    record_greedy(str(TARGET), prompts, NEW_TOKENS, alpha=0.6, seed=7, out=path)
    up = start_up(request, "--draft-model", f"replay:{path}", "--policy", "chain:4", profile=suite_profile)
    return up, Recording.load(path)


def test_replay_accepts_what_its_chain_kept(recorded):
    up, recording = recorded
    c = client(up.url)
    for index, (prompt, output) in enumerate(recording.records):
        resp = c.completions.create(model="target", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        assert resp.usage.completion_tokens == len(output)
        kept = recording.kept(index, len(output))
        pos = 1  # the prefill gave output[0]; each verify step's chain proposes output[pos:]
        steps = resp.model_extra["specserve"]["steps"]
        for _, nodes, accepted in steps:
            run = 0
            while run < nodes - 1 and pos + run < len(output) and kept[pos + run]:
                run += 1
            assert accepted == run, (index, pos, json.dumps(steps))
            pos += accepted + 1
        assert pos >= len(output) and any(a > 0 for _, _, a in steps)
    wait_all_free(up)
