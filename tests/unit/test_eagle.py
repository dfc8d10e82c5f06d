"""The EAGLE draft: a head over the target's features (services/draft/eagle_head.py, eagle.py, eagle_engine.py).

Fast: the target's runner returns the final norm's output as features (transformers' last hidden
state) without changing a logit; the target service returns them for every prefill chunk token and
for each verified tree's accepted path; the head's entries give the same predictions appended at once
or in pieces; a tree node attends to its ancestors only (its prediction is what appending its path as
entries gives); the engine speaks the draft protocol (features by position, root-only trees while
they are missing, a malformed tensor refused). Slow: `specserve up --draft-model <head>` gives
transformers' greedy text under every policy, verifying the head's trees.

Here: the tests that start no process and open no socket; the others are in tests/stack/test_eagle.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.draft.config import DraftConfig
from specserve.draft.eagle import EagleDrafter
from specserve.draft.eagle_engine import EagleDraftEngine
from specserve.draft.eagle_head import load_for_target
from specserve.shared.host.service_base import BadCall
from specserve.shared.runtime.batch import Chunk
from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec, Speculate, SpeculateEntry, VerifyEntry
from specserve.target.config import TargetConfig
from specserve.target.engine import TargetEngine
from tests.support.eagle import TARGET, make_head

PROMPT = [5, 17, 42, 99, 7, 3, 250, 18, 64, 9, 11, 300]




@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    make_head(out)
    return out


def test_runner_features_are_the_last_hidden_state_and_leave_the_logits_alone():
    runner = ModelRunner.from_dir(TARGET, num_blocks=64)
    plain = runner.forward([Chunk("a", PROMPT, logits_at=[len(PROMPT) - 1])])[0]
    runner.release("a")
    logits, features = runner.forward_features([Chunk("a", PROMPT, logits_at=[len(PROMPT) - 1])])
    assert torch.equal(logits[0], plain) and features[0].shape == (len(PROMPT), 384)
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0]
    torch.testing.assert_close(features[0], want, atol=1e-4, rtol=1e-4)
    assert runner.model.features is None and not runner.model.keep_features


def test_the_target_returns_features_for_chunks_and_accepted_paths():
    engine = TargetEngine(TargetConfig(model=str(TARGET), kv_blocks=64))
    greedy = SamplingSpec(0.0, 1.0, 0, None)
    reply, out = engine.forward(Forward([PrefillEntry("a", 0, 0, len(PROMPT), True, greedy)], [], features=True),
                                {"prefill_tokens": torch.tensor(PROMPT, dtype=torch.int32)})
    first = out["tokens"].tolist()
    assert reply.results[0].num_features == len(PROMPT) and out["features"].shape == (len(PROMPT), 384)
    # a tree whose first child is the target's own next token: the accepted path's features come back
    runner = ModelRunner.from_dir(TARGET, num_blocks=64)
    logits, _ = runner.forward_features([Chunk("x", PROMPT + first, logits_at=[len(PROMPT)])])
    nxt = int(logits[0][0].argmax())
    tree, parents = [first[0], nxt, (nxt + 1) % 512], [-1, 0, 0]
    reply, out = engine.forward(Forward([], [VerifyEntry("a", 1, len(PROMPT) + 1, 3)], features=True),
                                {"tree_tokens": torch.tensor(tree, dtype=torch.int32),
                                 "tree_parents": torch.tensor(parents, dtype=torch.int32)})
    result = reply.results[0]
    assert result.num_accepted >= 1 and result.num_features == result.num_tokens == len(out["features"])
    emitted = out["tokens"].tolist()
    runner.release("x")
    _, want = runner.forward_features([Chunk("x", PROMPT + first + emitted[:-1])])
    torch.testing.assert_close(out["features"], want[0][len(PROMPT):], atol=1e-4, rtol=1e-4)
    # without the flag: no features
    reply, out = engine.forward(Forward([PrefillEntry("b", 0, 0, 4, True, greedy)], []),
                                {"prefill_tokens": torch.tensor(PROMPT[:4], dtype=torch.int32)})
    assert reply.results[0].num_features == 0 and "features" not in out


def test_entries_appended_in_pieces_and_tree_nodes_see_only_their_path(tmp_path):
    drafter = EagleDrafter(make_head(tmp_path))
    torch.manual_seed(1)
    feats, toks = torch.randn(20, 384), torch.randint(0, 512, (20,))
    drafter.append([("a", feats, toks)])
    drafter.append([("b", feats[:7], toks[:7])])
    drafter.append([("b", feats[7:], toks[7:]), ("c", feats[:3], toks[:3])])
    torch.testing.assert_close(drafter.requests["b"].last, drafter.requests["a"].last, atol=1e-5, rtol=1e-5)
    trees, passes = drafter.speculate([("a", 1, 3, 2), ("c", 1, 2, 1)])
    assert passes == 2 and len(trees["a"].tokens) == 7 and len(trees["c"].tokens) == 3
    # the chain's second token is what the head predicts after its first, appended as a real entry
    chain, _ = drafter.speculate([("a", 1, 2, 1)])
    y1, y2 = chain["a"].tokens[1:]
    drafter.append([("a", drafter.requests["a"].last[None], torch.tensor([y1]))])
    assert y2 == int(drafter.head.vocab[drafter.head.logits(drafter.requests["a"].last).argmax()])
    # a width-2 tree's second layer: each node's score is its own path's alone (its parent appended
    # as a real entry after the committed ones gives the same log probability)
    drafter.truncate("a", 19)
    drafter.append([("a", feats[19:], toks[19:])])
    tree = drafter.speculate([("a", 1, 3, 4)])[0]["a"]
    index = {t: i for i, t in enumerate(drafter.head.vocab.tolist())}
    for node in range(5, len(tree.tokens)):  # layers 2 and 3
        path, p = [], tree.parents[node]
        while p > 0:
            path.insert(0, tree.tokens[p])
            p = tree.parents[p]
        d = EagleDrafter(drafter.head)
        d.append([("a", feats, toks)])
        for token in path:
            d.append([("a", d.requests["a"].last[None], torch.tensor([token]))])
        logp = torch.log_softmax(d.head.logits(d.requests["a"].last), -1)[index[tree.tokens[node]]]
        assert tree.logp[node] == pytest.approx(tree.logp[tree.parents[node]] + float(logp), abs=1e-4)


def test_the_engine_speaks_the_draft_protocol(head_dir):
    engine = EagleDraftEngine(DraftConfig(model=str(head_dir)))
    assert engine.reads_features and engine.hidden == 384
    prompt = PROMPT + [77]  # the prompt and the first token
    toks = {"tokens": torch.tensor(prompt, dtype=torch.int32)}
    # features not there yet: a root-only tree
    reply, out = engine.speculate(Speculate([SpeculateEntry("a", 0, len(prompt), len(prompt), 3, 1)]), toks)
    assert reply.trees[0].error is None and reply.trees[0].depth == 0 and out["tokens"].tolist() == [77]
    # the prompt's features arrive: entries for every committed token, a chain of 3 from the root
    feats = torch.randn(len(PROMPT), 384)
    reply, out = engine.speculate(Speculate([SpeculateEntry("a", 1, 0, len(prompt), 3, 1, 0, 0, len(PROMPT))]),
                                  {"features": feats})
    assert reply.trees[0].depth == 3 and out["parents"].tolist() == [-1, 0, 1, 2]
    assert engine.drafter.entries("a") == len(PROMPT)
    with pytest.raises(BadCall):
        engine.speculate(Speculate([SpeculateEntry("a", 2, 0, len(prompt), 1, 1, 0, 0, 2)]),
                         {"features": torch.randn(2, 100)})
    assert engine.release("a") and "a" not in engine.features and engine.drafter.entries("a") == 0


def test_an_int8_head_keeps_its_predictions(tmp_path):
    """Saved as int8 rows with per-row scales: under a third of the float32 file, every weight within half a
    step of its row's scale, and the predicted features close to the float32 head's."""
    head = make_head(tmp_path / "f32")
    head.save(tmp_path / "i8", str(TARGET), int8=True)
    small = load_for_target(tmp_path / "i8", TARGET)
    size = {k: (tmp_path / k / "eagle.safetensors").stat().st_size for k in ("f32", "i8")}
    assert size["i8"] < 0.3 * size["f32"]
    w, q = head.q_proj.weight, small.q_proj.weight
    assert ((w - q).abs() <= w.abs().amax(1, keepdim=True) / 254 + 1e-7).all()
    feats, toks = torch.randn(30, 384), torch.randint(0, 512, (30,))
    a, b = EagleDrafter(head), EagleDrafter(small)
    a.append([("r", feats, toks)])
    b.append([("r", feats, toks)])
    torch.testing.assert_close(a.requests["r"].last, b.requests["r"].last, atol=0.05, rtol=0.05)


def test_a_head_committed_compressed_is_found_and_unpacked(tmp_path):
    """A directory holding only eagle.safetensors.xz (as models/smollm2-eagle is committed) is a head; loading
    it writes eagle.safetensors out, and the loaded head equals the one saved."""
    import lzma

    from specserve.draft.eagle_head import is_eagle_dir

    head = make_head(tmp_path)
    weights = tmp_path / "eagle.safetensors"
    (tmp_path / "eagle.safetensors.xz").write_bytes(lzma.compress(weights.read_bytes()))
    saved = weights.read_bytes()
    weights.unlink()
    assert is_eagle_dir(tmp_path)
    loaded = load_for_target(tmp_path, TARGET)
    assert weights.read_bytes() == saved
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_the_head_on_the_cpu_kernels_predicts_as_in_float32(tmp_path):
    """`to_cpu_kernels` (q8_0 linears through the compiled operators, as the draft service runs the head):
    the predicted features close to float32's, the same greedy chain in most cases."""
    head = make_head(tmp_path)
    fast = load_for_target(tmp_path, TARGET)
    if not fast.to_cpu_kernels():
        pytest.skip("the compiled CPU operators are not built here")
    assert type(fast.head).__name__ == "QuantLinear"
    feats, toks = torch.randn(30, 384), torch.randint(0, 512, (30,))
    a, b = EagleDrafter(head), EagleDrafter(fast)
    a.append([("r", feats, toks)])
    b.append([("r", feats, toks)])
    torch.testing.assert_close(a.requests["r"].last, b.requests["r"].last, atol=0.05, rtol=0.05)
    la, lb = head.logits(a.requests["r"].last), fast.logits(b.requests["r"].last)
    assert int(la.argmax()) == int(lb.argmax()) or la.max() - la[lb.argmax()] < 0.05


def test_the_feature_log_keeps_rows_by_position():
    """The gateway's and the draft's FeatureLog: rows at their positions, grown as needed, a rewrite (a
    re-prefill) in place, a write past the known positions refused."""
    from specserve.shared.spec.feature_log import FeatureLog

    log = FeatureLog()
    rows = torch.arange(200 * 4, dtype=torch.float32).view(200, 4)
    assert log.read(0).shape == (0, 0) and not log.write(1, rows[1:3])
    assert log.write(0, rows[:10]) and log.write(10, rows[10:200]) and log.known == 200
    assert log.write(5, rows[5:8]) and log.known == 200  # a rewrite keeps what follows it
    assert torch.equal(log.read(0), rows) and torch.equal(log.read(150, 160), rows[150:160])
    assert log.read(200).shape == (0, 4) and not log.write(201, rows[:1]) and log.known == 200
