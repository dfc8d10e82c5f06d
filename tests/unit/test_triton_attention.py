"""The Triton paged attention kernel (shared/runtime/kernels/triton_attention.py), run through Triton's interpreter
(TRITON_INTERPRET=1, which tests/conftest.py sets where there is no GPU) on CPU tensors: the same kernel
the torch pass launches on CUDA.

- Against its torch reference on a ragged batch that mixes every kind of token (a decode, a prefill
  chunk over earlier context, a token tree, the draft's beam nodes over an earlier layer), for grouped
  query heads of 1, 2 and 3 per kv head, head widths 16 and 32, float32 and bfloat16 KV; and with long
  contexts split in parts (flash-decoding), where a token's output is the same bit for bit whatever shares
  its call (a grid of one part or of four) and whatever tile of tokens it is run in (one load of a prefix for
  a tree's nodes, or each token's own), and a chain verified as a tree gives the bits of its tokens decoded.
- The kernels compiled for GPUs (sm_90, sm_80) without one, which the interpreter does not check.
- The torch pass with `--kernels triton` against the same pass with SDPA on a tiny random model:
  prefill, a tree, and the KV commit of an accepted path, every logit within float32 tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specserve.shared.runtime.batch import Chunk, DraftNodes, Tree
from specserve.shared.runtime.block_manager import BlockManager
from specserve.shared.runtime.kernels import triton_attention
from specserve.shared.runtime.lean_inputs import build_lean_inputs
from specserve.shared.runtime.random_model import TINY_CONFIG, write_random_model
from specserve.shared.runtime.runner import ModelRunner

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="Triton is not installed")
BLOCK = 4


def _layout():
    """A batch of five entries over a pool of 4-token blocks, and the prior forest of the draft nodes."""
    blocks = BlockManager(96, BLOCK)
    blocks.append_slots({"decode": 13, "chunk": 6, "tree": 9, "beam": 7 + 3})  # committed context (+ 3 nodes)
    entries = [Chunk("decode", [1]), Chunk("chunk", [2, 3, 4, 5, 6]),
               Tree("tree", [7, 8, 9, 10, 11, 12], [-1, 0, 0, 1, 3, 2]),
               DraftNodes("beam", [13, 14, 15], [0, 2, -1]), Chunk("new", [16, 17, 18])]
    starts = [13, 6, 9, 10, 0]
    blocks.append_slots({e.request_id: len(e.tokens) for e in entries})
    return build_lean_inputs(entries, starts, blocks, {3: [-1, 0, -1]}).keys


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(2, 2, 16), (4, 2, 32), (6, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_its_reference(heads, kv_heads, dim, dtype):
    keys = _layout()
    gen = torch.Generator().manual_seed(heads * dim)
    tokens = keys.seq.numel()
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(96 * BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(96 * BLOCK, kv_heads, dim, generator=gen).to(dtype)
    args = (q, k, v, keys.tables, keys.seq, keys.prefix, keys.extra_off, keys.extra_slots, BLOCK)
    got = triton_attention.paged_attention(*args)
    ref = triton_attention.attention_reference(*args)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def _long_layout(names: list[str]):
    """Entries of `names` over one pool state: contexts of 1 to 58 keys (parts of 16 keys: up to four)."""
    blocks = BlockManager(96, BLOCK)
    blocks.append_slots({"long": 57, "mid": 20, "tree": 33, "short": 3})
    every = {"long": (Chunk("long", [1]), 57), "mid": (Chunk("mid", [2, 3, 4, 5, 6]), 20),
             "tree": (Tree("tree", [7, 8, 9, 10, 11, 12], [-1, 0, 0, 1, 3, 2]), 33),
             "short": (Chunk("short", [13, 14]), 3), "new": (Chunk("new", [16, 17, 18]), 0)}
    blocks.append_slots({e.request_id: len(e.tokens) for e, _ in every.values()})
    entries = [every[n] for n in names]
    return build_lean_inputs([e for e, _ in entries], [s for _, s in entries], blocks).keys


def _tensors(tokens, heads, kv_heads, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(96 * BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(96 * BLOCK, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (6, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_contexts_equal_the_reference(heads, kv_heads, dim, dtype):
    keys = _long_layout(["long", "mid", "tree", "short", "new"])
    q, k, v = _tensors(keys.seq.numel(), heads, kv_heads, dim, dtype, seed=heads)
    args = (q, k, v, keys.tables, keys.seq, keys.prefix, keys.extra_off, keys.extra_slots, BLOCK)
    assert int((keys.prefix + keys.extra_off[1:] - keys.extra_off[:-1]).max()) > 3 * 16  # four parts
    got = triton_attention.paged_attention(*args, split_n=16)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), triton_attention.attention_reference(*args).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_output_does_not_depend_on_what_shares_its_call(dtype):
    """Each entry alone, and all together (where the long one gives the grid four parts for every token): the same
    bits."""
    names = ["long", "mid", "tree", "short", "new"]
    together = _long_layout(names)
    q, k, v = _tensors(together.seq.numel(), 4, 2, 16, dtype, seed=3)
    out = triton_attention.paged_attention(q, k, v, together.tables, together.seq, together.prefix,
                                           together.extra_off, together.extra_slots, BLOCK, split_n=16)
    at = 0
    for name in names:
        alone = _long_layout([name])
        n = alone.seq.numel()
        got = triton_attention.paged_attention(q[at: at + n], k, v, alone.tables, alone.seq, alone.prefix,
                                               alone.extra_off, alone.extra_slots, BLOCK, split_n=16)
        assert torch.equal(got, out[at: at + n]), name
        at += n
    assert at == q.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tile_size_gives_the_same_bits(dtype):
    """Tiles of 1 (no token shares a load), 2, 4 and 8 tokens: the tree's nodes and the chunk's tokens share the
    reads of their prefix in some tiles, decodes of other requests share a tile in others; every token's output is
    the same bit for bit."""
    keys = _long_layout(["long", "tree", "mid", "short", "new"])
    q, k, v = _tensors(keys.seq.numel(), 4, 2, 16, dtype, seed=7)
    args = (q, k, v, keys.tables, keys.seq, keys.prefix, keys.extra_off, keys.extra_slots, BLOCK)
    alone = triton_attention.paged_attention(*args, split_n=16, tile=1)
    for tile in (2, 4, 8):
        assert torch.equal(triton_attention.paged_attention(*args, split_n=16, tile=tile), alone), tile
    with pytest.raises(ValueError, match="power of two"):
        triton_attention.paged_attention(*args, tile=3)


def test_tiles_by_default_only_where_a_row_has_several_tokens(monkeypatch):
    """Decodes alone run a token a program; a call with a tree runs tiles of TILE_TOKENS."""
    jit, grids = triton_attention._jit(), []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid[0])
            return jit.split_kernel[grid]

    monkeypatch.setattr(triton_attention, "_jit", lambda: type("J", (), {"split_kernel": Spy(),
                                                                          "combine_kernel": jit.combine_kernel}))
    for names in (["long", "mid", "short"], ["long", "tree", "short"]):
        blocks = BlockManager(96, BLOCK)
        blocks.append_slots({"long": 58, "mid": 21, "tree": 39, "short": 4})
        entries = {"long": Chunk("long", [1]), "mid": Chunk("mid", [2]), "short": Chunk("short", [3]),
                   "tree": Tree("tree", [7, 8, 9, 10, 11, 12], [-1, 0, 0, 1, 3, 2])}
        starts = {"long": 57, "mid": 20, "tree": 33, "short": 3}
        keys = build_lean_inputs([entries[n] for n in names], [starts[n] for n in names], blocks).keys
        q, k, v = _tensors(keys.seq.numel(), 4, 2, 16, torch.float32)
        triton_attention.paged_attention(q, k, v, keys.tables, keys.seq, keys.prefix, keys.extra_off,
                                         keys.extra_slots, BLOCK)
    assert grids == [3, -(-8 // triton_attention.TILE_TOKENS)]


def test_a_chains_nodes_equal_the_same_tokens_decoded_in_turn():
    """A chain of draft tokens verified as a tree over 37 committed keys, and the same tokens as a chunk (each
    one a token decoded at its position): the same keys in the same order, read through the tile's shared prefix
    for the tree's nodes and through each token's own slots for the chunk's, and the same bits (so a verified
    token's logits are those of plain decoding)."""
    chain = [7, 8, 9, 10, 11, 12]
    out = {}
    for name, entry in (("tree", Tree("r", chain, [-1, 0, 1, 2, 3, 4])), ("chunk", Chunk("r", chain))):
        blocks = BlockManager(96, BLOCK)
        blocks.append_slots({"d": 5, "r": 37 + len(chain)})
        keys = build_lean_inputs([Chunk("d", [1]), entry], [4, 37], blocks).keys
        q, k, v = _tensors(keys.seq.numel(), 4, 2, 16, torch.float32, seed=11)
        out[name] = triton_attention.paged_attention(q, k, v, keys.tables, keys.seq, keys.prefix, keys.extra_off,
                                                     keys.extra_slots, BLOCK, split_n=16)
    assert torch.equal(out["tree"], out["chunk"])


_COMPILE_FOR_A_GPU = """
import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.shared.runtime.kernels import triton_attention_jit as jit

ptr = {"bfloat16": "*bf16", "float32": "*fp32"}[sys.argv[1]]
ints = ("tables_ptr", "seq_ptr", "prefix_ptr", "extra_off_ptr", "extra_slots_ptr")
split = {**{n: ptr for n in ("q_ptr", "k_ptr", "v_ptr")}, "part_ptr": "*fp32", "ml_ptr": "*fp32",
         **{n: "*i32" for n in ints}, "scale": "fp32",
         **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kslot", "stride_kh", "max_blocks", "splits",
                               "tokens")}}
combine = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": ptr, "prefix_ptr": "*i32", "extra_off_ptr": "*i32",
           "stride_ot": "i32", "stride_oh": "i32", "splits": "i32"}
for arch, tile, (group, dim) in itertools.product((90, 80), (1, 4), ((4, 128), (3, 64))):
    shape = {"GROUP": group, "GROUP_PAD": 16, "D": dim, "SPLIT_N": 512}
    for fn, sig, consts in ((jit.split_kernel, split, {**shape, "BLOCK_SIZE": 16, "BLOCK_N": 16, "TILE": tile}),
                            (jit.combine_kernel, combine, shape)):
        sig = {**sig, **{name: "constexpr" for name in consts}}
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32))
print("compiled")
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_kernels_compile_for_a_gpu(dtype):
    """The interpreter runs what a GPU's compiler refuses (a variable of two shapes across a branch, say): the
    kernels compiled for an H100/H200 (sm_90) and an A100 (sm_80) here, without a GPU, at the 8B and a small
    shape, tiles of 1 and 4."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_A_GPU, dtype], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def test_a_head_width_the_kernel_cannot_take_is_refused():
    keys = _layout()
    q = torch.zeros(keys.seq.numel(), 2, 24)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        triton_attention.paged_attention(q, torch.zeros(8, 2, 24), torch.zeros(8, 2, 24), keys.tables, keys.seq,
                                         keys.prefix, keys.extra_off, keys.extra_slots, BLOCK)


def test_the_torch_pass_with_triton_attention_equals_sdpa(tmp_path):
    model_dir = write_random_model(tmp_path / "m", TINY_CONFIG, seed=5, std=0.1)
    runners = {k: ModelRunner.from_dir(model_dir, num_blocks=64, block_size=BLOCK, kernels=k)
               for k in ("triton", "torch")}
    assert runners["triton"].model.attention == "triton" and runners["torch"].model.attention == "sdpa"
    prompt = list(range(3, 30))
    tree = ([40, 41, 42, 43, 44], [-1, 0, 0, 2, 3])
    out = {}
    for name, runner in runners.items():
        (prefill,) = runner.forward([Chunk("r", prompt, logits_at=range(len(prompt)))])
        (verify,) = runner.forward([Tree("r", *tree)])
        runner.commit_tree("r", [0, 2, 3])
        (decode,) = runner.forward([Chunk("r", [7], logits_at=[0])])
        out[name] = torch.cat([prefill, verify, decode])
    torch.testing.assert_close(out["triton"], out["torch"], rtol=1e-4, atol=2e-5)


def test_passes_padded_to_their_buckets_give_the_unpadded_logits(tmp_path):
    """The padding the target's CUDA graphs use (shared/runtime/cuda_graphs.py), run eagerly here: every pass, a
    prefill, a tree, a batch of decodes beside a chunk, returns the unpadded pass's logits, buckets are
    reused, and the scratch block stays the only block the padding takes."""
    from specserve.shared.runtime.cuda_graphs import BucketKey

    model_dir = write_random_model(tmp_path / "m", TINY_CONFIG, seed=9, std=0.1)
    plain = ModelRunner.from_dir(model_dir, num_blocks=64, block_size=BLOCK, kernels="triton")
    padded = ModelRunner.from_dir(model_dir, num_blocks=64, block_size=BLOCK, kernels="triton")
    padded.use_graphs(capture=False)
    assert padded.num_free_blocks == plain.num_free_blocks - 1
    passes = [[Chunk("a", list(range(3, 14)), logits_at=[10]), Chunk("b", [5, 6, 7], logits_at=[0, 1, 2])],
              [Tree("a", [20, 21, 22, 23], [-1, 0, 0, 1]), Chunk("b", [8], logits_at=[0])],
              [Chunk("c", [9, 10, 11, 12, 13], logits_at=[4])]]
    for entries in passes:
        want = plain.forward(entries)
        got = padded.forward(entries)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5)
        for runner in (plain, padded):
            if runner.has_pending("a"):
                runner.commit_tree("a", [0, 2])
    assert padded.graphs is not None and set(padded.graphs.statics) == {
        BucketKey(16, 4, 4, 1, 4), BucketKey(8, 4, 4, 8, 8), BucketKey(8, 2, 2, 1, 1)}
    with pytest.raises(ValueError, match="Triton attention"):
        ModelRunner.from_dir(model_dir, num_blocks=8, block_size=BLOCK, kernels="torch").use_graphs(capture=False)


def test_the_targets_reply_says_when_its_pass_captured_a_cuda_graph(monkeypatch):
    """The target flags a pass that captured a graph (`ForwardReply.warmup`, which the gateway's cost model skips).
    Capture needs a GPU: here the graphs run eagerly and a new bucket counts as a capture, as on CUDA."""
    from specserve.shared.runtime.cuda_graphs import bucket_key
    from specserve.shared.wire.messages import Forward, PrefillEntry, SamplingSpec, VerifyEntry
    from specserve.target.config import TargetConfig
    from specserve.target.engine import TargetEngine

    engine = TargetEngine(TargetConfig(kv_blocks=64, threads=1, kernels="triton"))
    engine.runner.use_graphs(capture=False)
    graphs, run = engine.runner.graphs, engine.runner.graphs.run

    def run_counting(inputs):
        graphs.captures += bucket_key(inputs) not in graphs.statics
        return run(inputs)

    monkeypatch.setattr(graphs, "run", run_counting)
    greedy = SamplingSpec(temperature=0.0)

    def prefill(rid: str, tokens: list[int]):
        return engine.forward(Forward(prefill=[PrefillEntry(rid, 0, 0, len(tokens), True, greedy)]),
                              {"prefill_tokens": torch.tensor(tokens, dtype=torch.int32)})

    first, out = prefill("a", [3, 4, 5, 6, 7])
    again, _ = prefill("b", [8, 9, 10, 11, 12])
    assert first.warmup and not again.warmup and graphs.captures == 1  # the same bucket: replayed
    root = {"tree_tokens": out["tokens"][:1], "tree_parents": torch.tensor([-1], dtype=torch.int32)}
    decode, _ = engine.forward(Forward(verify=[VerifyEntry("a", 1, 6, 1)]), root)
    assert decode.results[0].error is None and decode.warmup and graphs.captures == 2  # one token: a new bucket
