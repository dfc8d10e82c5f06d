"""The bundled demo pair (models/) through our runtime: tokenizer, transformers parity, held-out split.

The pair and the prompt sets are built by `python -m training.build_demo_pair` (see models/README.md).

Here: the tests that start no process and open no socket; the others are in tests/service/test_demo_models.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from specserve.shared.runtime.generate import generate
from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.runtime.runner import ModelRunner
from training.corpus import is_held_out
from training.tokenizer import chat_text

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
WORKLOADS = ROOT / "bench" / "workloads"
CATEGORIES = {"short": (32, 128), "medium": (200, 500), "long": (1000, 2000)}


def _records(category: str) -> list[dict]:
    with open(WORKLOADS / f"{category}.jsonl") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODELS / "target")


@pytest.fixture(scope="module", params=["target", "draft"])
def pair_member(request):
    name = request.param
    hf = AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.float32).eval()
    return name, hf, ModelRunner.from_dir(MODELS / name, num_blocks=512)


def test_model_directories_are_standard_and_small():
    total = 0
    for name in ("target", "draft"):
        d = MODELS / name
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json"):
            assert (d / f).is_file(), f"{d / f} missing"
        total += (d / "model.safetensors").stat().st_size
        assert json.loads((d / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert total <= 60 * 2**20, f"weights take {total / 2**20:.1f} MiB, over the 60 MB budget"
    target, draft = (ModelConfig.from_dir(MODELS / n) for n in ("target", "draft"))
    assert 10e6 <= target.num_parameters() <= 30e6
    assert 10 <= target.num_parameters() / draft.num_parameters() <= 30
    digest = {n: hashlib.sha256((MODELS / n / "tokenizer.json").read_bytes()).hexdigest() for n in ("target", "draft")}
    assert digest["target"] == digest["draft"], "the pair must share one tokenizer"


def test_tokenizer_round_trips_held_out_text_and_any_bytes(tokenizer):
    assert 4096 <= len(tokenizer) <= 8192
    texts = [r["prompt"] for c in CATEGORIES for r in _records(c)]
    texts += ["", " ", "\t\n\r\n", "naïve café — 世界 🙂\x00\x7f", "\u200b\ufeff", "a" * 3000]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_chat_template_renders_with_special_tokens(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nimport os<|end|>\n<|assistant|>\n"
    # The chat snippets the pair was trained on are this rendering followed by the reply.
    prompt = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True)
    assert chat_text("import os", "import sys\n") == prompt + "import sys\n<|end|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for special in ("<|system|>", "<|user|>", "<|end|>", "<|assistant|>"):
        assert tokenizer.convert_tokens_to_ids(special) in ids


def test_workload_sets_come_from_held_out_files_within_bounds(tokenizer):
    for category, (lo, hi) in CATEGORIES.items():
        records = _records(category)
        assert len(records) >= 200
        assert len({r["prompt"] for r in records}) == len(records), "duplicate prompts"
        for r in records:
            path = r["source"].removeprefix("Lib/").rsplit(":", 1)[0]
            assert is_held_out(path), f"{r['id']} comes from training file {path}"
            assert lo <= r["prompt_tokens"] <= hi
            assert r["prompt_tokens"] == len(tokenizer.encode(r["prompt"], add_special_tokens=False))
            assert r["max_tokens"] > 0


def test_held_out_split_is_about_ten_percent():
    paths = [f"pkg/module_{i}.py" for i in range(5000)]
    share = sum(map(is_held_out, paths)) / len(paths)
    assert 0.08 < share < 0.12
    assert [is_held_out(p) for p in paths[:50]] == [is_held_out(p) for p in paths[:50]]


def _hf_greedy(model, prompt: list[int], n: int, stop: list[int]) -> list[int]:
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=stop[0])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=cfg)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_equals_transformers(pair_member, tokenizer):
    """Token for token, on held-out prompts of every category (the long one crosses 1000 tokens)."""
    name, hf, runner = pair_member
    records = _records("short")[:4] + _records("medium")[:1] + _records("long")[:1]
    prompts = {r["id"]: tokenizer.encode(r["prompt"], add_special_tokens=False) for r in records}
    stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|end|>")]
    ours = generate(runner, prompts, max_new_tokens=24, stop_ids=set(stop))
    for rid, prompt in prompts.items():
        assert ours[rid] == _hf_greedy(hf, prompt, 24, stop), f"{name} {rid}"
    assert runner.num_free_blocks == 512


def test_runtime_stops_on_generation_config_eos(tokenizer):
    cfg = ModelConfig.from_dir(MODELS / "target")
    assert set(cfg.eos_token_ids) == {tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|end|>")}


def test_acceptance_measurement_is_calibrated(tmp_path):
    """The simulator behind models/README.md's figures: a draft identical to the target accepts
    all k tokens (k + 1 per step), a random-weight draft almost none (about 1 per step)."""
    from specserve.shared.runtime.random_model import write_random_model
    from training.evaluate import simulate

    tok = AutoTokenizer.from_pretrained(MODELS / "draft")
    runner = ModelRunner.from_dir(MODELS / "draft", num_blocks=256)
    prompts = {r["id"]: tok.encode(r["prompt"], add_special_tokens=False) for r in _records("short")[:6]}
    conts = generate(runner, prompts, 24 + 4)
    assert simulate(runner, prompts, conts, 3, 1, 24) >= 3.9
    # Beam search can prune the greedy path (a lower first step with a surer follow-up outranks it).
    assert simulate(runner, prompts, conts, 3, 2, 24) >= 3.5
    cfg = json.loads((MODELS / "draft" / "config.json").read_text())
    noise = ModelRunner.from_dir(write_random_model(tmp_path / "noise", cfg, seed=3), num_blocks=256)
    assert simulate(noise, prompts, conts, 3, 1, 24) < 1.3
    assert runner.num_free_blocks == 256 and noise.num_free_blocks == 256


def test_compressed_bundled_weights_are_unpacked_when_missing_or_stale(tmp_path):
    """models/*/model.safetensors.xz (committed compressed: the working tree a GPU machine is sent stays under
    64 MiB) is written out beside itself once, again when the packed file is newer, and by the loader where
    nothing else did."""
    import lzma
    import os
    import shutil

    from specserve.shared.runtime.loader import weight_files
    from specserve.shared.runtime.model_store import unpack_bundled

    src = MODELS / "draft"
    model = tmp_path / "draft"
    shutil.copytree(src, model)
    weights = model / "model.safetensors"
    packed = model / "model.safetensors.xz"
    packed.write_bytes(lzma.compress(weights.read_bytes()))
    weights.unlink()
    assert unpack_bundled(tmp_path) == [weights]
    assert weights.read_bytes() == (src / "model.safetensors").read_bytes()
    assert unpack_bundled(tmp_path) == []  # up to date
    os.utime(packed, (weights.stat().st_mtime + 10,) * 2)  # a pull brought a newer packed file
    assert unpack_bundled(tmp_path) == [weights]
    weights.unlink()
    assert set(weight_files(model)) == set(weight_files(src))  # the loader unpacks it itself
    assert list(model.glob(".*tmp")) == []


def test_a_model_packed_as_int8_rows_unpacks_to_its_float_weights(tmp_path):
    """`pack_int8_rows` (how models/smollm2-draft is committed): the packed file is smaller than the bfloat16
    one xz gives, unpacking writes the model's own dtype back with every matrix within one step of its row's
    scale (half a step of int8, half of bfloat16's rounding) and the norms exact, transformers and our runtime
    load it, and the weights a build leaves are the unpacked ones."""
    import lzma
    import os
    import shutil

    from safetensors.torch import load_file

    from specserve.shared.runtime.model_store import pack_int8_rows, unpack

    model = tmp_path / "draft"
    shutil.copytree(MODELS / "draft", model)
    (model / "model.safetensors.xz").unlink()
    weights = model / "model.safetensors"
    before = load_file(weights)
    packed = pack_int8_rows(weights)
    assert packed.stat().st_size < 0.8 * len(lzma.compress(weights.read_bytes()))
    built = weights.read_bytes()
    weights.unlink()
    assert unpack(packed) and weights.read_bytes() == built
    after = load_file(weights)
    assert after.keys() == before.keys()
    for name, w in before.items():
        assert after[name].dtype == w.dtype == torch.bfloat16, name
        if w.dim() == 2:
            step = w.float().abs().amax(1, keepdim=True) / 127
            assert ((after[name].float() - w.float()).abs() <= step).all(), name
        else:
            assert torch.equal(after[name], w), name
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompt = [5, 17, 300, 42, 7, 1000]
    ours = generate(ModelRunner.from_dir(model, num_blocks=64), {"r": prompt}, max_new_tokens=8, stop_ids={0})["r"]
    assert ours == _hf_greedy(hf, prompt, 8, [0])
    os.utime(packed, (weights.stat().st_mtime + 10,) * 2)
    assert unpack(packed) and weights.read_bytes() == built  # a newer packed file is written out again
