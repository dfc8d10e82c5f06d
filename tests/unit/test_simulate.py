"""The simulation's models, in process: the latency model reproduces its table; the acceptance model's
per-depth acceptance matches its parameters (chains) and its path probabilities (trees) within
sampling error; the simulated runner keeps the real block accounting and sleeps the modelled time;
the simulated target and draft agree on the true continuation; a bad preset is one clear error."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specserve.draft.config import DraftConfig
from specserve.draft.simulated import simulated_engine as simulated_draft
from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.simulate.acceptance import AcceptanceModel, accept_choices
from specserve.shared.simulate.latency import LatencyModel
from specserve.shared.simulate.preset import PresetError, load_preset, preset_names
from specserve.shared.simulate.runner import SimulatedRunner
from specserve.shared.simulate.text import load_corpus
from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec, Speculate, SpeculateEntry, VerifyEntry
from specserve.target.config import TargetConfig
from specserve.target.simulated import simulated_engine as simulated_target

SAMPLES = 4000


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_reproduces_its_table(name):
    preset = load_preset(name)
    assert preset.sources, f"preset {name} names no sources"
    for model in (preset.target, preset.draft):
        for tokens, ms in zip(model.tokens, model.ms):
            assert model.table_ms(tokens) == pytest.approx(ms, rel=1e-12)
            # one entry without context adds exactly the per-request term
            assert model.pass_ms([(tokens, 0)]) == pytest.approx(ms + model.per_request_ms, rel=1e-12)


def test_time_scale_multiplies_every_modelled_time():
    base, slow = load_preset("llama2-7b-a100"), load_preset("llama2-7b-a100,time_scale=4")
    entries = [(1, 300), (16, 900), (128, 0)]
    for a, b in ((base.target, slow.target), (base.draft, slow.draft)):
        assert b.tokens == a.tokens
        assert b.pass_ms(entries) == pytest.approx(4 * a.pass_ms(entries), rel=1e-12)
    assert slow.acceptance == base.acceptance
    assert base.spec == str(base.path) and load_preset(slow.spec).target == slow.target  # what up passes on


def test_latency_model_is_piecewise_linear_in_tokens_and_linear_in_context():
    m = LatencyModel((1, 8, 64), (10.0, 12.0, 40.0), per_request_ms=0.5, per_context_token_us=2.0)
    assert m.table_ms(0) == 10.0 and m.table_ms(4) == pytest.approx(10 + 2 * 3 / 7)
    assert m.table_ms(128) == pytest.approx(40 + 28 / 56 * 64)  # the last slope continues
    # 3 entries, 12 new tokens, 300 context tokens
    assert m.pass_ms([(4, 100), (4, 100), (4, 100)]) == pytest.approx(m.table_ms(12) + 1.5 + 0.6)
    # a 256-token prefill chunk after 1000 prompt tokens pays 256 x 1000 attended pairs
    p = LatencyModel((1, 8, 64), (10.0, 12.0, 40.0), per_pair_ns=10.0)
    assert p.pass_ms([(256, 1000)]) == pytest.approx(p.table_ms(256) + 256 * 1000 * 10 / 1e6)
    with pytest.raises(ValueError):
        LatencyModel((8, 4), (1.0, 2.0))


def test_padded_attention_charges_every_entry_of_a_group_for_its_longest():
    kw = dict(per_context_token_us=2.0, per_pair_ns=10.0)
    own, padded = LatencyModel((1, 8, 64), (10.0, 12.0, 40.0), **kw), LatencyModel((1, 8, 64), (10.0, 12.0, 40.0),
                                                                                  padded_attention=True, **kw)
    even = [(4, 100)] * 3  # equal entries: nothing to pad, the two forms agree (every point of the fit)
    assert padded.pass_ms(even) == pytest.approx(own.pass_ms(even), rel=1e-12)
    # 8 decodes, one of them after a 1,500-token prompt: all 8 read 1,500 keys
    uneven = [(1, 1500)] + [(1, 100)] * 7
    assert padded.features(uneven) == (8, 8, 8 * 1500, 8 * 1500)
    assert own.features(uneven) == (8, 8, 2200, 2200)
    # the keys are padded to the longest context + new tokens: an 8-token chunk and a decode after 100
    # tokens gather 101 keys each; with Q = 8 that is 93 context keys per entry (uniform: exactly c)
    assert padded.features([(8, 0), (1, 100)]) == (9, 2, 2 * 93, 2 * 8 * 93)
    # a 256-token chunk beside 4 decodes: shared.batch.attention_groups puts the chunk and the first
    # decode in one group (padding within 2x), the other three in a second, padded to the longest
    mixed = [(256, 512), (1, 40), (1, 90), (1, 30), (1, 20)]
    assert padded.features(mixed) == (260, 5, 2 * 512 + 3 * 90, 2 * 256 * 512 + 3 * 90)
    assert padded.pass_ms(mixed) == pytest.approx(padded.table_ms(260) + 2.0 * (1024 + 270) / 1e3
                                                  + 10.0 * (2 * 256 * 512 + 270) / 1e6)


def test_cpu_demo_pads_as_the_real_attention_does_and_the_gpu_presets_do_not():
    assert load_preset("cpu-demo").target.padded_attention and load_preset("cpu-demo").draft.padded_attention
    assert not load_preset("llama2-7b-a100").target.padded_attention
    assert load_preset("cpu-demo,time_scale=2").target.padded_attention  # the time scale keeps it


def _accepted(tokens, parents, truth):
    acc = accept_choices(tokens, parents, torch.tensor(_truth_at_nodes(tokens, parents, truth)), None)
    return len(acc.path) - 1


def _truth_at_nodes(tokens, parents, truth):
    """The true next token after each node: truth[depth] on the true path, anything elsewhere."""
    depth = [0] * len(tokens)
    on_path = [True] + [False] * (len(tokens) - 1)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
        on_path[i] = on_path[parents[i]] and tokens[i] == truth[depth[i] - 1]
    return [truth[depth[i]] if on_path[i] and depth[i] < len(truth) else -1 for i in range(len(tokens))]


def _wrong(k, node, count):
    return [10_000 + 100 * k + i for i in range(count)]


def test_chain_acceptance_per_depth_matches_alpha():
    model = AcceptanceModel((0.8, 0.6, 0.5), rank_tail=0.5, concentration=4.0)
    rng = random.Random(1)
    truth = [1, 2, 3, 4, 5]
    reached = [0] * 6
    for _ in range(SAMPLES):
        tokens, parents, _ = model.propose(rng, truth[:4], _wrong, 4, 1, 0)
        n = _accepted(tokens, parents, truth)
        for k in range(n + 1):
            reached[k] += 1
    for k, alpha in zip(range(1, 5), (0.8, 0.6, 0.5, 0.5)):  # the parameters, the last repeating
        rate = reached[k] / reached[k - 1]
        sigma = math.sqrt(alpha * (1 - alpha) / reached[k - 1])
        assert abs(rate - alpha) < 4 * sigma, (k, rate, alpha)


@pytest.mark.parametrize("depth,width", [(1, 3), (3, 2), (4, 4)])
def test_tree_acceptance_matches_its_path_probabilities(depth, width):
    """Calibration: the share of trees whose true path reaches depth k equals the mean total path
    probability of their depth-k nodes; at depth 1 both equal the closed form of the rank model."""
    model = AcceptanceModel((0.7, 0.55), rank_tail=0.6, concentration=3.0)
    rng = random.Random(depth * 10 + width)
    truth = list(range(1, depth + 2))
    hits = [0] * (depth + 1)
    mass = [0.0] * (depth + 1)
    for _ in range(SAMPLES):
        tokens, parents, probs = model.propose(rng, truth[:depth], _wrong, depth, width, 0)
        assert len(tokens) == 1 + depth * width
        n = _accepted(tokens, parents, truth)
        level = [0] * len(tokens)
        for i in range(1, len(tokens)):
            level[i] = level[parents[i]] + 1
            mass[level[i]] += probs[i]
        for k in range(1, n + 1):
            hits[k] += 1
    for k in range(1, depth + 1):
        share, expected = hits[k] / SAMPLES, mass[k] / SAMPLES
        sigma = math.sqrt(max(expected * (1 - expected), 1e-4) / SAMPLES)
        assert abs(share - expected) < 4 * sigma, (k, share, expected)
    closed = 0.7 + 0.3 * (1 - 0.6 ** (width - 1))
    assert abs(hits[1] / SAMPLES - closed) < 4 * math.sqrt(closed * (1 - closed) / SAMPLES)


def test_simulated_runner_keeps_block_accounting_and_sleeps_the_modelled_time():
    slept = []
    latency = LatencyModel((1, 16), (5.0, 20.0), per_request_ms=1.0)
    runner = SimulatedRunner(64, 16, 4096, latency, None, sleep=slept.append)
    runner.forward([Chunk("a", list(range(1, 21)), logits_at=[19]), Chunk("b", [7] * 3)])
    assert runner.blocks.num_slots("a") == 20 and runner.num_free_blocks == 64 - 2 - 1
    modelled = latency.pass_ms([(20, 0), (3, 0)])
    assert runner.modelled_ms == modelled and 0 < sum(slept) <= modelled / 1e3  # less its own bookkeeping
    runner.forward([Tree("a", [5, 6, 7, 8], [-1, 0, 0, 1])])
    assert runner.blocks.num_slots("a") == 24
    runner.commit_tree("a", [0, 1, 3])
    assert runner.blocks.num_slots("a") == 23 and runner.history["a"][-3:] == [5, 6, 8]
    runner.release("a")
    runner.release("b")
    assert runner.num_free_blocks == 64


def test_simulated_target_and_draft_agree_on_the_true_text():
    """The draft's tree holds true tokens that the target accepts; the target emits exactly the
    true continuation, so greedy output is reproducible and real text."""
    target = simulated_target(TargetConfig(simulate="cpu-demo", kv_blocks=256))
    draft = simulated_draft(DraftConfig(simulate="cpu-demo", kv_blocks=256))
    assert target.stats().device == "simulated"  # (no device: --async-scheduling auto leaves it off)
    preset = load_preset("cpu-demo")
    truth = load_corpus(preset.corpus, preset.tokenizer, preset.seed)
    prompt = truth.tokens[100:140]
    expected = truth.continuation(prompt, 60)
    reply, out = target.forward(Forward(prefill=[PrefillEntry("r", 0, 0, len(prompt), True, SamplingSpec())]),
                                {"prefill_tokens": torch.tensor(prompt, dtype=torch.int32)})
    committed = prompt + out["tokens"].tolist()
    new = list(committed)
    step, accepted = 1, 0
    while len(committed) < len(prompt) + 50:
        sreply, tree = draft.speculate(Speculate([SpeculateEntry("r", step, len(new), len(committed), 4, 2)]),
                                       {"tokens": torch.tensor(new, dtype=torch.int32)})
        tokens, parents = tree["tokens"].tolist(), tree["parents"].tolist()
        assert sreply.trees[0].error is None and len(tokens) == 1 + 4 * 2
        vreply, out = target.forward(Forward(verify=[VerifyEntry("r", step, len(committed), len(tokens))]),
                                     {"tree_tokens": torch.tensor(tokens, dtype=torch.int32),
                                      "tree_parents": torch.tensor(parents, dtype=torch.int32)})
        assert vreply.results[0].error is None
        accepted += vreply.results[0].num_accepted
        new = out["tokens"].tolist()
        committed += new
        step += 1
    assert committed[len(prompt):] == expected[: len(committed) - len(prompt)]
    assert accepted > step  # the draft is informative: more than one accepted token per step on average
    assert target.stats().used_blocks > 0 and target.release("r") and target.stats().used_blocks == 0
    assert draft.release("r") and draft.stats().used_blocks == 0


@pytest.mark.parametrize("spec,words", [("", "needs a preset"), ("no-such-preset", "unknown preset"),
                                        ("missing.toml", "no such preset file"),
                                        ("cpu-demo,speed=2", "unknown override"),
                                        ("cpu-demo,time_scale=fast", "must be a number"),
                                        ("cpu-demo,time_scale=0", "must be > 0")])
def test_a_bad_spec_is_one_clear_error(spec, words):
    with pytest.raises(PresetError, match=words):
        load_preset(spec)


def test_a_malformed_preset_file_names_the_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[target]\ntokens = [1, 2]\nms = [1.0]\n[draft]\ntokens=[1]\nms=[1.0]\n"
                   "[acceptance]\ndepth_accept = [0.5]\n")
    with pytest.raises(PresetError, match=r"\[target\].*as many"):
        load_preset(str(bad))
    bad.write_text("[target]\ntokens = [1]\nms = [1.0]\npadded_attention = 1\n[draft]\ntokens=[1]\nms=[1.0]\n"
                   "[acceptance]\ndepth_accept = [0.5]\n")
    with pytest.raises(PresetError, match=r"\[target\].*padded_attention must be true or false"):
        load_preset(str(bad))
    bad.write_text("not = [toml")
    with pytest.raises(PresetError, match="not valid TOML"):
        load_preset(str(bad))
