"""Parity of the paged runtime (specserve.shared) with Hugging Face transformers.

Every check runs a tiny float32 model built and saved by transformers, loads the saved directory
with `ModelRunner.from_dir` through each pass (the compiled CPU operators' and the torch pass; a
sliding-window model only through the torch pass, which alone has windows), and compares logits
(tight float32 tolerances) and argmax tokens with
the reference `*ForCausalLM` forward on the equivalent plain sequence: full prefill, chunked
prefill, token-by-token decode, token trees (and the KV copy of `commit_tree`), and ragged batches
that mix all three. The loader's error paths and greedy generation are covered too.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.generate import generate
from specserve.shared.runtime.model_config import ModelLoadError
from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.spec.token_tree import path_to

RTOL, ATOL = 1e-4, 2e-5
BLOCK_SIZE = 4  # small, so every sequence spans many blocks
NUM_BLOCKS = 96
VOCAB = 128

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    attn_implementation="eager",
)

# name -> (config class, model class, extra config kwargs)
VARIANTS = {
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
    "llama_llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            head_dim=32,  # explicit head_dim != hidden_size / num_heads
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,  # low/high/medium frequency bands all occur
            },
        ),
    ),
    "llama_linear": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ),
    "llama_yarn": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,  # ramp spans several frequencies; mscale != 1
            }
        ),
    ),
    "llama_tied_bias": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    ),
    "mistral_window": (
        MistralConfig,
        MistralForCausalLM,
        dict(sliding_window=6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
}



@dataclass
class HFModel:
    name: str
    model: torch.nn.Module
    path: Path
    kernels: str = "auto"  # the pass `runner()` loads: loader.KERNELS

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Reference float32 logits [len(ids), vocab] of the plain sequence."""
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].float()

    def runner(self, **kw) -> ModelRunner:
        kw.setdefault("num_blocks", NUM_BLOCKS)
        kw.setdefault("block_size", BLOCK_SIZE)
        kw.setdefault("kernels", self.kernels)
        kw.setdefault("activations", "float32")  # transformers' parity: float32 products
        return ModelRunner.from_dir(self.path, **kw)


def _build(name: str, root: Path, kernels: str = "auto") -> HFModel:
    config_cls, model_cls, extra = VARIANTS[name]
    cfg = config_cls(**_COMMON, **extra)
    torch.manual_seed(sum(map(ord, name)))
    model = model_cls(cfg).eval()
    with torch.no_grad():  # biases (Qwen2 q/k/v, Llama attention_bias/mlp_bias) start at zero
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.2)
    path = root / name
    model.save_pretrained(path)
    return HFModel(name, model, path, kernels)


PASSES = [(name, kernels) for name in VARIANTS for kernels in ("cpu", "torch")
          if not (kernels == "cpu" and name == "mistral_window")]


@pytest.fixture(scope="module", params=PASSES, ids=[f"{name}-{kernels}" for name, kernels in PASSES])
def hf_model(request, tmp_path_factory) -> HFModel:
    name, kernels = request.param
    return _build(name, tmp_path_factory.mktemp("hf_models"), kernels)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> HFModel:
    return _build("llama", tmp_path_factory.mktemp("hf_llama"))


# ---- helpers ---------------------------------------------------------------------------------


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def assert_match(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Tight float32 closeness, and identical argmax tokens (a reference near-tie of < 1e-4 may
    resolve either way, but only between the tied tokens)."""
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape, what
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    ours_top, ref_top = ours.argmax(-1), ref.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4
    assert torch.equal(ours_top[clear], ref_top[clear]), f"{what}: argmax differs"
    for row in (~clear).nonzero().flatten().tolist():
        assert ref[row, ours_top[row]] >= ref[row].max() - 1e-4, f"{what}: argmax differs at {row}"


def assert_tree_nodes_match(ours: torch.Tensor, hf_model: HFModel, context: list[int], tree_toks: list[int],
                            parents: list[int], what: str) -> None:
    """Each tree node's logits equal HF's on the context plus the node's root-to-node path."""
    for node in range(len(tree_toks)):
        seq = context + [tree_toks[i] for i in path_to(parents, node)]
        assert_match(ours[node : node + 1], hf_model.logits(seq)[-1:], f"{what} {node}")


def random_tree(seed: int, n: int) -> tuple[list[int], list[int]]:
    """A random token tree of n nodes (root token included) with distinct tokens among siblings.

    Parents are drawn from the last few nodes, so the tree is both bushy and several levels deep.
    """
    rng = random.Random(seed)
    toks, parents = [rng.randrange(VOCAB)], [-1]
    for i in range(1, n):
        parent = rng.randrange(max(0, i - 3), i)
        siblings = {toks[j] for j in range(1, i) if parents[j] == parent}
        toks.append(rng.choice([t for t in range(VOCAB) if t not in siblings]))
        parents.append(parent)
    return toks, parents


def deepest_gapped_path(parents: list[int]) -> list[int]:
    """A root-to-leaf path, as deep as possible, whose nodes are not already in sequence order
    (so commit_tree has to move KV rows)."""
    leaves = [i for i in range(len(parents)) if i not in parents]
    paths = [path_to(parents, leaf) for leaf in leaves]
    paths = [p for p in paths if p != list(range(len(p)))]
    assert paths, "tree has no path that needs a KV move"
    return max(paths, key=len)


# ---- 1. per-variant forward parity ---------------------------------------------------------


def test_prefill_all_positions(hf_model: HFModel):
    runner = hf_model.runner()
    assert runner.config.num_parameters() == hf_model.model.num_parameters()
    prompt = tokens(1, 23)
    (ours,) = runner.forward([Chunk("r", prompt, logits_at=range(len(prompt)))])
    assert_match(ours, hf_model.logits(prompt), "prefill")
    assert runner.num_tokens("r") == len(prompt)
    runner.release("r")
    assert runner.num_free_blocks == NUM_BLOCKS


def test_chunked_prefill(hf_model: HFModel):
    runner = hf_model.runner()
    prompt = tokens(2, 26)
    ref = hf_model.logits(prompt)
    got, start = [], 0
    for size in (5, 7, len(prompt) - 12):
        chunk = prompt[start : start + size]
        (logits,) = runner.forward([Chunk("r", chunk, logits_at=range(size))])
        got.append(logits)
        start += size
        assert runner.num_tokens("r") == start
    assert_match(torch.cat(got), ref, "chunked prefill")
    # logits_at picks rows; an empty logits_at returns none
    runner.release("r")
    (last2,) = runner.forward([Chunk("r", prompt[:9], logits_at=[8, 3])])
    assert_match(last2, ref[[8, 3]], "logits_at order")
    (none,) = runner.forward([Chunk("r", prompt[9:12])])
    assert none.shape == (0, VOCAB)
    (after,) = runner.forward([Chunk("r", prompt[12:14], logits_at=[1])])
    assert_match(after, ref[13:14], "after a chunk without logits")


def test_decode_token_by_token(hf_model: HFModel):
    runner = hf_model.runner()
    seq = tokens(3, 22)
    ref = hf_model.logits(seq)
    (pre,) = runner.forward([Chunk("r", seq[:9], logits_at=[8])])
    got = [pre]
    for i in range(9, len(seq)):
        (step,) = runner.forward([Chunk("r", [seq[i]], logits_at=[0])])
        got.append(step)
    assert runner.num_tokens("r") == len(seq)
    assert_match(torch.cat(got), ref[8:], "decode")


def test_decodes_of_several_requests_in_one_pass(hf_model: HFModel):
    """The lean passes (batch.py's `_plain_inputs`): single-token decodes of requests with different
    contexts in one pass (one-token chunks and one-node trees), each with a key-length mask; then a
    lone decode and a lone first chunk with no mask at all. Contexts start inside Mistral's window of
    6 and grow past it."""
    runner = hf_model.runner()
    prompts = {"a": tokens(30, 2), "b": tokens(31, 5), "c": tokens(32, 11)}
    for rid, prompt in prompts.items():
        (first,) = runner.forward([Chunk(rid, prompt, logits_at=[len(prompt) - 1])])
        assert_match(first, hf_model.logits(prompt)[-1:], f"{rid} first chunk")
    seqs = {rid: list(p) for rid, p in prompts.items()}
    for step in range(6):
        toks = tokens(40 + step, 3)
        outs = runner.forward(
            [Chunk("a", [toks[0]], logits_at=[0]), Tree("b", [toks[1]], [-1]), Chunk("c", [toks[2]], logits_at=[0])]
        )
        runner.commit_tree("b", [0])
        for (rid, seq), tok, out in zip(seqs.items(), toks, outs):
            seq.append(tok)
            assert_match(out, hf_model.logits(seq)[-1:], f"{rid} decode {step}")
    for step, tok in enumerate(tokens(50, 8)):  # "a" alone: context 8, past the window of 6
        (out,) = runner.forward([Tree("a", [tok], [-1])])
        runner.commit_tree("a", [0])
        seqs["a"].append(tok)
        assert_match(out, hf_model.logits(seqs["a"])[-1:], f"a alone {step}")
    (short,) = runner.forward([Chunk("d", [7, 8, 9], logits_at=[0, 1, 2])])
    assert_match(short, hf_model.logits([7, 8, 9]), "a lone first chunk within every window")
    (alone,) = runner.forward([Chunk("d", [10], logits_at=[0])])
    assert_match(alone, hf_model.logits([7, 8, 9, 10])[-1:], "a lone decode within every window")
    for rid in ("a", "b", "c", "d"):
        runner.release(rid)
    assert runner.num_free_blocks == NUM_BLOCKS


def test_tree_nodes_and_commit(hf_model: HFModel):
    runner = hf_model.runner()
    prompt = tokens(4, 11)
    runner.forward([Chunk("r", prompt)])
    free_before = runner.num_free_blocks
    tree_toks, parents = random_tree(5, 11)

    (ours,) = runner.forward([Tree("r", tree_toks, parents)])
    assert ours.shape == (len(tree_toks), VOCAB)
    assert runner.num_tokens("r") == len(prompt)  # still pending
    assert_tree_nodes_match(ours, hf_model, prompt, tree_toks, parents, "tree node")

    path = deepest_gapped_path(parents)
    runner.commit_tree("r", path)
    accepted = prompt + [tree_toks[i] for i in path]
    assert runner.num_tokens("r") == len(accepted)
    nxt = tokens(6, 3)
    (step,) = runner.forward([Chunk("r", nxt, logits_at=[0, 1, 2])])
    assert_match(step, hf_model.logits(accepted + nxt)[-3:], "decode after commit_tree")

    # A second tree on the committed path, with a subset of logits, then discard it.
    tree2, parents2 = random_tree(7, 6)
    (sub,) = runner.forward([Tree("r", tree2, parents2, logits_at=[5, 2])])
    base = accepted + nxt
    for row, node in enumerate([5, 2]):
        seq = base + [tree2[i] for i in path_to(parents2, node)]
        assert_match(sub[row : row + 1], hf_model.logits(seq)[-1:], f"second tree node {node}")
    runner.discard_tree("r")
    assert runner.num_tokens("r") == len(base)
    (step,) = runner.forward([Chunk("r", [17], logits_at=[0])])
    assert_match(step, hf_model.logits(base + [17])[-1:], "decode after discard_tree")

    runner.release("r")
    assert runner.num_free_blocks == NUM_BLOCKS > free_before


def test_ragged_batch(hf_model: HFModel):
    runner = hf_model.runner()
    p_prompt, d_prompt, t_prompt = tokens(10, 19), tokens(11, 13), tokens(12, 9)
    # Pass 1: first prefill chunk of p, whole prompts of d and t.
    outs = runner.forward(
        [Chunk("p", p_prompt[:6], logits_at=[5]), Chunk("d", d_prompt, logits_at=[12]), Chunk("t", t_prompt)]
    )
    assert [o.shape[0] for o in outs] == [1, 1, 0]
    assert_match(outs[0], hf_model.logits(p_prompt[:6])[-1:], "p chunk 1")
    assert_match(outs[1], hf_model.logits(d_prompt)[-1:], "d prefill")

    # Pass 2: rest of p's prompt (all logits), one decode token for d, a tree for t.
    tree_toks, parents = random_tree(13, 10)
    d_tok = 42
    p_out, d_out, t_out = runner.forward(
        [
            Chunk("p", p_prompt[6:], logits_at=range(len(p_prompt) - 6)),
            Chunk("d", [d_tok], logits_at=[0]),
            Tree("t", tree_toks, parents),
        ]
    )
    assert_match(p_out, hf_model.logits(p_prompt)[6:], "p chunk 2")
    d_seq = d_prompt + [d_tok]
    assert_match(d_out, hf_model.logits(d_seq)[-1:], "d decode")
    assert_tree_nodes_match(t_out, hf_model, t_prompt, tree_toks, parents, "t tree node")

    # Pass 3 after committing t's path: a tree for d, decode tokens for t and p.
    path = deepest_gapped_path(parents)
    runner.commit_tree("t", path)
    t_seq = t_prompt + [tree_toks[i] for i in path]
    d_tree, d_parents = random_tree(14, 7)
    t_out, d_out, p_out = runner.forward(
        [Chunk("t", [3, 99], logits_at=[0, 1]), Tree("d", d_tree, d_parents), Chunk("p", [64], logits_at=[0])]
    )
    assert_match(t_out, hf_model.logits(t_seq + [3, 99])[-2:], "t after commit")
    assert_match(p_out, hf_model.logits(p_prompt + [64])[-1:], "p decode")
    for node in range(len(d_tree)):
        seq = d_seq + [d_tree[i] for i in path_to(d_parents, node)]
        assert_match(d_out[node : node + 1], hf_model.logits(seq)[-1:], f"d tree node {node}")
    runner.discard_tree("d")
    for rid in ("p", "d", "t"):
        runner.release(rid)
    assert runner.num_free_blocks == NUM_BLOCKS


# ---- 2. greedy generation ---------------------------------------------------------------------


def _hf_greedy(hf_model: HFModel, prompt: list[int], n: int) -> list[int]:
    gen_cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = hf_model.model.generate(torch.tensor([prompt]), generation_config=gen_cfg)
    new = out[0, len(prompt) :].tolist()
    assert len(new) == n, "HF stopped early"
    return new


@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_greedy_generation(hf_model: HFModel, prefill_chunk):
    prompts = {"a": tokens(20, 7), "b": tokens(21, 12)}
    runner = hf_model.runner()
    ours = generate(runner, prompts, max_new_tokens=12, prefill_chunk=prefill_chunk)
    for rid, prompt in prompts.items():
        assert ours[rid] == _hf_greedy(hf_model, prompt, 12), rid
    assert runner.num_free_blocks == NUM_BLOCKS


# ---- 3. bfloat16 smoke ------------------------------------------------------------------------


def test_bfloat16_close_to_float32_reference(hf_model: HFModel):
    """bf16 weights and KV: finite, close to the float32 reference, and on average no further
    from it than transformers' own bf16 forward is (mean over 21 x 128 logits: not flaky). Only the torch
    pass runs bfloat16."""
    if hf_model.kernels == "cpu":
        with pytest.raises(ModelLoadError, match="CPU in float32 only"):
            hf_model.runner(dtype="bfloat16")
        return
    runner = hf_model.runner(dtype="bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.kv.data.dtype == torch.bfloat16
    prompt = tokens(30, 20)
    (ours,) = runner.forward([Chunk("r", prompt, logits_at=range(len(prompt)))])
    (decode,) = runner.forward([Chunk("r", [5], logits_at=[0])])
    got = torch.cat([ours, decode])
    ref = hf_model.logits(prompt + [5])
    with torch.no_grad():
        hf_bf16 = copy.deepcopy(hf_model.model).to(torch.bfloat16)
        hf_bf16_logits = hf_bf16(torch.tensor([prompt + [5]])).logits[0].float()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=0.0, atol=0.5)
    ours_err = (got - ref).abs().mean().item()
    hf_err = (hf_bf16_logits - ref).abs().mean().item()
    assert ours_err <= 1.5 * hf_err + 0.005, f"bf16 mean error {ours_err:.4f} vs transformers' {hf_err:.4f}"
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, f"bf16 argmax agrees with float32 on only {agree:.0%} of positions"


# ---- 4. loader ---------------------------------------------------------------------------------


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


def _edit_weights(path: Path, edit) -> None:
    """Load model.safetensors, let `edit(state)` change the tensor dict in place, save it back."""
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_sharded_checkpoint_matches_single_file(hf_llama: HFModel, tmp_path):
    sharded = tmp_path / "sharded"
    hf_llama.model.save_pretrained(sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    prompt = tokens(40, 15)
    entry = [Chunk("r", prompt, logits_at=range(len(prompt)))]
    (single,) = hf_llama.runner().forward(entry)
    (shards,) = ModelRunner.from_dir(sharded, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE).forward(entry)
    assert torch.equal(single, shards)
    assert_match(shards, hf_llama.logits(prompt), "sharded")

    # A shard named by the index but absent from the directory.
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="missing safetensors shard") as err:
        ModelRunner.from_dir(sharded, num_blocks=4)
    assert shard.name in str(err.value)


def test_missing_config(hf_llama: HFModel, tmp_path):
    d = _copy(hf_llama.path, tmp_path / "m", skip=("config.json",))
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelRunner.from_dir(d, num_blocks=4)
    with pytest.raises(ModelLoadError, match="not found"):
        ModelRunner.from_dir(tmp_path / "nowhere", num_blocks=4)


def test_missing_weights(hf_llama: HFModel, tmp_path):
    d = _copy(hf_llama.path, tmp_path / "m", skip=("model.safetensors",))
    with pytest.raises(ModelLoadError, match="missing weights") as err:
        ModelRunner.from_dir(d, num_blocks=4)
    assert "model.safetensors" in str(err.value)


def test_missing_tensor(hf_llama: HFModel, tmp_path):
    d = _copy(hf_llama.path, tmp_path / "m")
    _edit_weights(d, lambda state: state.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match="lacks tensor") as err:
        ModelRunner.from_dir(d, num_blocks=4)
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)


def test_wrong_shape_and_unexpected_tensor(hf_llama: HFModel, tmp_path):
    d = _copy(hf_llama.path, tmp_path / "shape")
    _edit_weights(d, lambda state: state.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ModelLoadError, match="model.norm.weight has shape"):
        ModelRunner.from_dir(d, num_blocks=4)

    d = _copy(hf_llama.path, tmp_path / "extra")
    _edit_weights(d, lambda state: state.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(ModelLoadError, match="model.layers.0.self_attn.o_proj.bias"):
        ModelRunner.from_dir(d, num_blocks=4)


def test_unsupported_architecture(hf_llama: HFModel, tmp_path):
    d = _copy(hf_llama.path, tmp_path / "m")
    _edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture") as err:
        ModelRunner.from_dir(d, num_blocks=4)
    assert "GPT2LMHeadModel" in str(err.value)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
        {"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    ],
    ids=["longrope", "dynamic-4x-layout"],
)
def test_unsupported_rope_type(hf_llama: HFModel, tmp_path, rope):
    d = _copy(hf_llama.path, tmp_path / "m")
    _edit_config(d, **rope)
    name = (rope["rope_parameters"] or rope.get("rope_scaling"))
    name = name.get("rope_type") or name.get("type")
    with pytest.raises(ModelLoadError, match="unsupported rope") as err:
        ModelRunner.from_dir(d, num_blocks=4)
    assert repr(name) in str(err.value)


def test_transformers_4x_rope_layout_loads(hf_model: HFModel, tmp_path):
    """The same config.json rewritten in the 4.x layout (top-level rope_theta + rope_scaling with
    the legacy `type` key) gives the same logits."""
    d = _copy(hf_model.path, tmp_path / "m")
    params = dict(json.loads((d / "config.json").read_text())["rope_parameters"])
    theta = params.pop("rope_theta")
    assert theta == VARIANTS[hf_model.name][2]["rope_parameters"]["rope_theta"]
    rope_type = params.pop("rope_type")
    scaling = None if rope_type == "default" else {"type": rope_type, **params}
    _edit_config(d, rope_parameters=None, rope_theta=theta, rope_scaling=scaling)
    prompt = tokens(41, 12)
    entry = [Chunk("r", prompt, logits_at=range(len(prompt)))]
    (ours,) = ModelRunner.from_dir(d, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE).forward(entry)
    assert_match(ours, hf_model.logits(prompt), "4.x rope layout")


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    from specserve.shared.runtime.loader import dtype_name, parse_dtype

    assert parse_dtype("auto", "cuda:1") is torch.bfloat16 and parse_dtype("auto", "cpu") is torch.float32
    assert parse_dtype("float16", "cuda") is torch.float16 and dtype_name("auto", torch.device("cuda")) == "bfloat16"
    with pytest.raises(ValueError, match="unsupported dtype"):
        parse_dtype("int8")
