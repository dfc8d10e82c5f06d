"""The prepared GPU run: every check of the CUDA path in one call, one JSON and one Markdown report.

    bash bench/gpu_suite.sh --out-dir "$OUT"                 # on a lent GPU (installs the carried wheels first)
    .venv/bin/python bench/gpu_suite.py --dry-run            # here, on CPU: tiny shapes, Triton's interpreter

Sections, in this order (each is timed; one that fails is reported with its error and the next runs):
1. **parity**: our pass against transformers on the device, for the demo target and SmolLM2-135M-Instruct
   (where installed), in float32 and bfloat16, with SDPA attention, the Triton kernel, and the Triton
   kernel at bucketed shapes through CUDA graphs, for a random and a text prompt of 64 tokens: max |logit
   difference| at the prompt's last position, whether 32 greedy tokens equal transformers `generate`, and
   where they part, transformers' own top-2 gap there.
1b. **bits**: the Triton kernel on the device, per shape's head layout: a call of decodes, a tree and a chain
   verified as a tree, in tiles of 1, 2 and 4 tokens a program and by default: the same bits in every tiling, the
   chain's nodes the bits of its tokens decoded (lossless verification), and the largest difference from the
   kernel's torch reference.
2. **curves**: median pass time (ms) of the torch pass on random weights of SmolLM2-135M's, Llama-3.2-1B's and
   Llama-3.1-8B's shapes (timing only: weights do not change it), bfloat16, for decodes of 1-64 requests at
   512 tokens of context, trees of 4-64 nodes for 1 and 16 requests, and decodes at 128-4096 tokens of
   context; each point with SDPA, the Triton kernel eagerly, and the Triton kernel replayed as CUDA graphs.
3. **ipc**: a tensor of draft features (tokens x 4096, bfloat16) sent draft -> target over a Unix socket, as
   payload bytes against as a CUDA IPC handle (shared/wire/cuda_ipc.py), to an RpcServer in another process:
   median round trip.
4. **offload**: the draft service's Offload / Reload (Nightjar), in process: the demo and SmolLM2 drafts'
   weights to pinned host memory and back over PCIe, median of 3.
5. **stack**: `specserve up --device cuda --dtype bfloat16` on the demo pair, a gateway per policy
   (joint, the default; none; chain:4; none@fifo, `none` with FIFO admission), at 1, 16 and 64 requests in
   flight (64 greedy tokens each, short prompts, the chat tier with best effort allowed, so that nothing is
   refused), each gateway warmed at that concurrency first (untimed: the shapes' CUDA graphs are captured
   then): tokens/s, TTFT and TPOT p50 (`specserve bench`) and the admission's outcomes during the run;
   every policy's greedy texts against `none`'s; the profile, the SLO classes and the cost model's error;
   and transformers `generate` on the GPU at the same batch sizes on the same prompts.
6. **overhead**: bench/step_overhead.py's part 1 on the device: the near-null target (the demo draft served as
   the target) under `none` at 1, 16, 64 and 256 in flight, without and with `--async-scheduling`, and the
   default at 64 both ways, then `none` and the default at 64 with a chat SLO no step comes near (the flag
   at auto); per mode the iteration, the target's pass and the rest (the stack's own time), ms per
   iteration, and tokens/s.
7. **sim**: a simulator preset written from passes of the demo pair measured on this GPU (the latency model of
   bench/sim_fit_latency.py, acceptance of the cpu-demo preset: the same pair), and the simulated stack
   (`up --simulate`) against the real one of section 5 at 16 in flight: the error of tokens/s and TPOT p50.

`--dry-run` runs every section end to end on CPU in minutes: the tiny random shape for the curves,
float32, Triton kernels through the interpreter, the stack on the CPU at 1 and 2 in flight with 8
tokens; CUDA IPC is skipped there (tests/unit/test_cuda_ipc.py covers its lifecycle). tests/service/test_gpu_suite.py
runs it, so the suite cannot rot. Where `specserve` is not installed (a lent GPU machine), the suite
imports it from this checkout through a folder of links (.cache/pkg). Reports: gpu_suite.json and
gpu_suite.md in --out-dir (default bench/results/gpu_suite/).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import platform
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if "--dry-run" in sys.argv and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported


def _importable() -> None:
    """Make `specserve` importable from this checkout where it is not installed (services/ is the package,
    shared/ its `shared`), for this process and the services it starts."""
    try:
        import specserve  # noqa: F401
        return
    except ImportError:
        pass
    pkg = ROOT / ".cache" / "pkg" / "specserve"
    pkg.mkdir(parents=True, exist_ok=True)
    for src in [*(ROOT / "services").iterdir(), ROOT / "shared"]:
        link = pkg / src.name
        if not link.exists():
            link.symlink_to(src)
    sys.path.insert(0, str(pkg.parent))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pkg.parent), os.environ.get("PYTHONPATH")]))


_importable()
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from specserve.shared.runtime.batch import Chunk, Tree  # noqa: E402
from specserve.shared.runtime.kernels import triton_attention  # noqa: E402
from specserve.shared.runtime.runner import ModelRunner  # noqa: E402

SMOLLM2 = "smollm2-135m-instruct"
SHAPES: dict[str, dict[str, Any]] = {  # random-weight Llama shapes for the pass-time curves
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}
MODES = ("sdpa", "triton", "graphs")
# The stack's load: relaxed SLOs, best effort allowed, so that admission serves every request and the run
# measures speed (tokens/s, TTFT, TPOT), not refusals.
STACK_MIX = "chat=1.0:short"


@dataclass
class Plan:
    """What each section runs: the GPU run's sizes, or the dry run's."""

    device: str
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    prompt_tokens: int = 64
    new_tokens: int = 32
    shapes: tuple[str, ...] = tuple(SHAPES)
    curve_dtype: str = "bfloat16"
    decode_batches: tuple[int, ...] = (1, 4, 16, 64)
    decode_context: int = 512
    trees: tuple[tuple[int, int], ...] = ((1, 4), (1, 16), (1, 64), (16, 4), (16, 16))  # (requests, nodes)
    kv_lengths: tuple[tuple[int, int], ...] = ((1, 128), (1, 1024), (1, 4096), (16, 1024))  # (requests, context)
    reps: int = 10
    ipc_tokens: tuple[int, ...] = (64, 1024)
    ipc_width: int = 4096
    ipc_reps: int = 30
    stack_dtype: str = "bfloat16"
    concurrency: tuple[int, ...] = (1, 16, 64)
    policies: tuple[str, ...] = ("joint", "none", "chain:4", "none@fifo")  # NAME@fifo: FIFO admission
    stack_tokens: int = 64
    lossless_prompts: int = 8
    sim_concurrency: int = 16
    overhead_inflight: tuple[int, ...] = (1, 16, 64, 256)  # the near-null target's requests in flight
    overhead_seconds: float = 6.0  # per closed loop: 2 gateways at each level, the default twice, a loose pair
    extra_shapes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def requests(self, concurrency: int) -> int:
        return max(8, 2 * concurrency) if concurrency > 1 else 8


def dry_plan() -> Plan:
    from specserve.shared.runtime.random_model import TINY_CONFIG

    return Plan(device="cpu", dtypes=("float32", "bfloat16"), prompt_tokens=12, new_tokens=4, shapes=("tiny",),
                curve_dtype="float32", decode_batches=(1, 2), decode_context=24, trees=((1, 4), (2, 3)),
                kv_lengths=((1, 8), (1, 40)), reps=1, ipc_tokens=(4,), ipc_width=64, ipc_reps=3,
                stack_dtype="float32", concurrency=(1, 2), stack_tokens=8, lossless_prompts=2, sim_concurrency=2,
                overhead_inflight=(1, 2), overhead_seconds=2.0,
                extra_shapes={"tiny": {k: v for k, v in TINY_CONFIG.items() if k not in ("architectures",)}})


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- 1. parity ---------------------------------------------------------------------------------------------

def parity(plan: Plan) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from specserve.shared.runtime import model_store

    models = [("demo", ROOT / "models" / "target")]
    if model_store.installed(SMOLLM2):
        models.append((SMOLLM2, model_store.models_dir() / SMOLLM2))
    rows: list[dict] = []
    for name, model_dir in models:
        for dtype, (kind, prompt) in itertools.product(plan.dtypes, _parity_prompts(model_dir, plan.prompt_tokens)):
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(plan.device).eval()
            with torch.inference_mode():
                ids = torch.tensor([prompt], device=plan.device)
                theirs = hf(ids).logits[0, -1].float()
                gen = hf.generate(ids, max_new_tokens=plan.new_tokens, min_new_tokens=plan.new_tokens,
                                  do_sample=False, output_scores=True, return_dict_in_generate=True)
            reference = gen.sequences[0, len(prompt):].tolist()
            scores = [s[0].float() for s in gen.scores]  # transformers' logits at each greedy step
            del hf
            for kernels, graphs in (("torch", False), ("triton", False), ("triton", True)):
                runner = ModelRunner.from_dir(model_dir, num_blocks=64, dtype=dtype, device=plan.device,
                                              weights="float32", kernels=kernels)
                if graphs:
                    runner.use_graphs(capture=plan.device.startswith("cuda"))
                ours = runner.forward([Chunk("p", prompt, logits_at=[plan.prompt_tokens - 1])])[0][0]
                tokens = [int(ours.argmax())]
                while len(tokens) < plan.new_tokens:
                    tokens.append(int(runner.forward([Chunk("p", [tokens[-1]], logits_at=[0])])[0][0].argmax()))
                first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
                row = {"model": name, "prompt": kind, "dtype": dtype,
                       "attention": "sdpa" if kernels == "torch" else "triton",
                       "graphs": ("captured" if plan.device.startswith("cuda") else "padded, eager") if graphs
                       else "no",
                       "max_abs_logit_diff": float((ours - theirs).abs().max()), "greedy_equal": tokens == reference,
                       "first_difference": first,
                       # how close transformers' own top two were where the tokens part: a near-tie flips on one
                       # rounding step of the dtype
                       "their_top2_gap": None if first is None else float(scores[first].topk(2).values.diff().abs())}
                rows.append(row)
                print("  parity", row, flush=True)
                del runner
    return rows


def _parity_prompts(model_dir: Path, n: int) -> list[tuple[str, list[int]]]:
    """Two prompts of `n` tokens: random token ids (seeded), and text (the workloads' first prompts through the
    model's tokenizer, cut to `n`)."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    rng = random.Random(0)
    text = "\n".join(_prompts(8))
    return [("random", [rng.randrange(3, vocab) for _ in range(n)]),
            ("text", tok(text, add_special_tokens=False)["input_ids"][:n])]


# ---- 1b. the Triton kernel's bits on the device ------------------------------------------------------------

def kernel_bits(plan: Plan) -> list[dict]:
    """Per shape (its head layout; the curves' dtype): one call of decodes at contexts up to the longest of
    `kv_lengths`, a binary tree of 16 nodes and a chain of 6 verified as a tree, through the Triton kernel on
    the device. Checked: every tile size (1, 2, 4 tokens a program) and the default give the same bits; the chain's
    nodes give the bits of the same tokens as a chunk (each decoded at its position: lossless verification);
    the largest difference from the kernel's torch reference (float32 softmax)."""
    from specserve.shared.runtime.block_manager import BlockManager
    from specserve.shared.runtime.lean_inputs import build_lean_inputs

    shapes, rows = {**SHAPES, **plan.extra_shapes}, []
    longest = max(c for _, c in plan.kv_lengths)
    contexts = {f"d{i}": max(1, longest * i // 7) for i in range(1, 8)} | {"tree": longest // 3, "chain": longest // 2}
    tree = Tree("tree", list(range(3, 19)), [-1] + [(i - 1) // 2 for i in range(1, 16)])
    chain = list(range(20, 26))
    gen = torch.Generator(device=plan.device).manual_seed(0)
    for shape in plan.shapes:
        raw = shapes[shape]
        heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
        dim, dtype = raw["hidden_size"] // heads, getattr(torch, plan.curve_dtype)
        blocks = BlockManager(sum(-(-(c + 16) // 16) for c in contexts.values()) + 1, 16)
        blocks.append_slots({r: c + (16 if r == "tree" else 6 if r == "chain" else 1) for r, c in contexts.items()})
        out = {}
        for name, last in (("tree", Tree("chain", chain, [-1, 0, 1, 2, 3, 4])), ("chunk", Chunk("chain", chain))):
            entries = [Chunk(r, [1]) for r in contexts if r.startswith("d")] + [tree, last]
            keys = build_lean_inputs(entries, list(contexts.values()), blocks).keys.to(torch.device(plan.device))
            if name == "tree":
                q = torch.randn(keys.seq.numel(), heads, dim, generator=gen, device=plan.device).to(dtype)
                k, v = (torch.randn(blocks.num_blocks * 16, kv_heads, dim, generator=gen, device=plan.device).to(dtype)
                        for _ in range(2))
            args = (q, k, v, keys.tables, keys.seq, keys.prefix, keys.extra_off, keys.extra_slots, 16)
            out[name] = {tile: triton_attention.paged_attention(*args, tile=tile) for tile in (None, 1, 2, 4)}
            if name == "tree":
                reference = triton_attention.attention_reference(*args)
        every = out["tree"]
        row = {"shape": shape, "dtype": plan.curve_dtype, "tokens": int(q.shape[0]),
               "tiles_equal": all(torch.equal(every[t], every[1]) for t in every),
               "chain_equals_decoded": all(torch.equal(out["tree"][t][-6:], out["chunk"][t][-6:]) for t in every),
               "max_abs_diff_vs_reference": float((every[None].float() - reference.float()).abs().max())}
        rows.append(row)
        print("  bits", row, flush=True)
    return rows


# ---- 2. curves ---------------------------------------------------------------------------------------------

def random_runner(raw: dict[str, Any], dtype: str, device: str, num_blocks: int) -> ModelRunner:
    """A ModelRunner over a random-weight Llama of `raw`'s shape, built on the device in `dtype` directly."""
    from specserve.shared.runtime.model import CausalLM
    from specserve.shared.runtime.model_config import ModelConfig
    from specserve.shared.runtime.rope import inverse_frequencies

    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
    config = ModelConfig.from_dict({**base, **raw})
    with torch.device("meta"):
        model = CausalLM(config).to(getattr(torch, dtype))
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.model.rotary_emb.inv_freq = inverse_frequencies(config)[0].to(device)
    model.attention = "triton"
    return ModelRunner(model.eval(), num_blocks)


def curves(plan: Plan) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    shapes = {**SHAPES, **plan.extra_shapes}
    for shape in plan.shapes:
        out[shape] = _Curves(plan, shape, shapes[shape]).run()
        if plan.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


class _Curves:
    """One shape's points. Requests are prefilled once per context (with SDPA, long chunks) and shared by the
    points at that context; after each timed pass its decode token is truncated or its tree discarded."""

    def __init__(self, plan: Plan, shape: str, raw: dict[str, Any]):
        self.plan, self.shape = plan, shape
        contexts: dict[int, int] = {}  # context -> the most requests a point needs at it
        for b, c in [*((b, plan.decode_context) for b in plan.decode_batches),
                     *((b, plan.decode_context) for b, _ in plan.trees), *plan.kv_lengths]:
            contexts[c] = max(contexts.get(c, 0), b)
        widest = max(n for _, n in plan.trees)
        blocks = sum(n * (-(-(c + widest) // 16) + 1) for c, n in contexts.items()) + 64
        self.runner = random_runner(raw, plan.curve_dtype, plan.device, blocks)
        self.runner.use_graphs(capture=plan.device.startswith("cuda"))
        self.graphed, self.runner.graphs = self.runner.graphs, None
        self.rng = torch.Generator().manual_seed(1)
        self.pools: dict[int, list[str]] = {}  # context -> requests prefilled to it

    def run(self) -> list[dict]:
        p = self.plan
        rows = [self.point("decode", b, 1, p.decode_context) for b in p.decode_batches]
        rows += [self.point("tree", b, n, p.decode_context) for b, n in p.trees]
        rows += [self.point("context", b, 1, c) for b, c in p.kv_lengths]
        return rows

    def tokens(self, n: int) -> list[int]:
        return torch.randint(1, self.runner.vocab_size, (n,), generator=self.rng).tolist()

    def mode(self, name: str) -> None:
        self.runner.model.attention = self.runner.inputs_for = "sdpa" if name == "sdpa" else "triton"
        self.runner.graphs = self.graphed if name == "graphs" else None

    def pool(self, n: int, context: int) -> list[str]:
        rids = self.pools.setdefault(context, [])
        self.mode("sdpa")
        while len(rids) < n:
            rid = f"c{context}-{len(rids)}"
            self.runner.forward([Chunk(rid, self.tokens(context))])
            rids.append(rid)
        return rids[:n]

    def timed(self, make: Callable[[], list], undo: Callable[[], None]) -> float:
        times = []
        for _ in range(self.plan.reps + 2):  # two warm-ups: Triton's compile, a graph's capture
            batch = make()
            sync(self.plan.device)
            t0 = time.perf_counter()
            self.runner.forward(batch)
            sync(self.plan.device)
            times.append((time.perf_counter() - t0) * 1e3)
            undo()
        return statistics.median(times[2:])

    def point(self, kind: str, n: int, nodes: int, context: int) -> dict:
        rids = self.pool(n, context)
        runner = self.runner
        row: dict[str, Any] = {"kind": kind, "requests": n, "nodes": nodes, "context": context}
        parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]  # a binary tree

        def make() -> list:
            if nodes == 1:
                return [Chunk(r, self.tokens(1), logits_at=[0]) for r in rids]
            return [Tree(r, self.tokens(nodes), parents) for r in rids]

        def undo() -> None:
            for r in rids:
                if nodes == 1:
                    runner.truncate(r, context)
                else:
                    runner.discard_tree(r)

        for name in MODES:
            self.mode(name)
            if name == "graphs" and n * nodes > self.graphed.max_tokens:
                row[name] = None  # larger passes run eagerly
                continue
            row[name] = round(self.timed(make, undo), 4)
        if kind == "tree":  # the kernel with one token a program: no tree node shares its prefix's reads
            self.mode("triton")
            tiles, triton_attention.TILE_TOKENS = triton_attention.TILE_TOKENS, 1
            try:
                row["triton_tile1"] = round(self.timed(make, undo), 4)
            finally:
                triton_attention.TILE_TOKENS = tiles
            row["tile_vs_tile1"] = round(row["triton_tile1"] / row["triton"], 3)
        row["triton_vs_sdpa"] = round(row["sdpa"] / row["triton"], 3)
        if row["graphs"]:
            row["graphs_vs_triton"] = round(row["triton"] / row["graphs"], 3)
        print(f"  {self.shape}", row, flush=True)
        return row


# ---- 3. CUDA IPC against the socket -------------------------------------------------------------------------

async def _echo_server(address: str, ipc: bool, device: str) -> None:
    """The receiving end: takes the features onto its device and answers with a one-element tensor."""
    from specserve.shared.wire.messages import SpeculateReply
    from specserve.shared.wire.rpc import RpcServer

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # the server's own errors, in the suite's report

    async def handler(body, tensors):
        x = tensors["x"].to(device, non_blocking=False)
        return SpeculateReply([], 0.0, 0.0, 0.0, 0, 0), {"y": x.reshape(-1)[:1].clone()}

    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: traceback.print_exception(
        ctx.get("exception") or RuntimeError(ctx.get("message")), file=sys.stderr))
    server = RpcServer(handler, cuda_ipc=ipc)
    print("ready", await server.start(address), flush=True)
    await asyncio.Event().wait()


def ipc(plan: Plan) -> list[dict]:
    from specserve.shared.wire.messages import Speculate, SpeculateReply
    from specserve.shared.wire.rpc import RpcClient

    cuda = plan.device.startswith("cuda")
    rows: list[dict] = []
    for use_ipc in (False, True):
        if use_ipc and not cuda:
            rows.append({"path": "cuda_ipc", "skipped": "needs CUDA (tests/unit/test_cuda_ipc.py runs its lifecycle)"})
            continue
        sock = Path(tempfile.mkdtemp()) / "echo.sock"
        errors = sock.with_name("echo.stderr")
        with open(errors, "w") as err:  # faulthandler: a crash in CUDA's IPC shows where it happened
            proc = subprocess.Popen([sys.executable, "-X", "faulthandler", __file__, "--echo-server", f"unix:{sock}",
                                     "--device", plan.device] + (["--ipc"] if use_ipc else []),
                                    stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.startswith("ready"):
                raise RuntimeError(f"the echo server did not start: {line!r}")
            address = line.split()[1]

            async def measure(tokens: int, address: str = address, use_ipc: bool = use_ipc) -> float:
                client = await RpcClient.connect(address, cuda_ipc=use_ipc)
                x = torch.randn(tokens, plan.ipc_width, device=plan.device).to(torch.bfloat16)
                times = []
                try:
                    for _ in range(plan.ipc_reps + 2):
                        sync(plan.device)
                        t0 = time.perf_counter()
                        _, out = await client.call(Speculate([]), SpeculateReply, {"x": x})
                        sync(plan.device)
                        times.append((time.perf_counter() - t0) * 1e3)
                        assert out["y"].numel() == 1
                finally:
                    await client.close()
                return statistics.median(times[2:])

            for tokens in plan.ipc_tokens:
                try:
                    ms = asyncio.run(measure(tokens))
                except Exception as exc:
                    try:  # a process that crashed has written all it will
                        proc.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        pass
                    raise RuntimeError(f"{'CUDA IPC' if use_ipc else 'socket'} round trip of {tokens} tokens failed; "
                                       f"the receiving process (exit status {proc.poll()}) wrote:\n"
                                       f"{errors.read_text()[-4000:]}") from exc
                row = {"path": "cuda_ipc" if use_ipc else "socket", "tokens": tokens, "width": plan.ipc_width,
                       "mb": round(tokens * plan.ipc_width * 2 / 2**20, 3), "round_trip_ms": round(ms, 4)}
                rows.append(row)
                print("  ipc", row, flush=True)
        finally:
            proc.kill()
            proc.wait()
    return rows


# ---- 3b. the draft offloaded to host memory and back (Nightjar's offload) ------------------------------------

def offload(plan: Plan) -> list[dict]:
    """The draft service's Offload / Reload, in process: weights to (pinned) host memory and back, and the
    KV pool freed and rebuilt; median of 3 of each, for the demo draft and the SmolLM2 draft."""
    from specserve.draft.config import DraftConfig
    from specserve.draft.engine import DraftEngine

    rows = []
    for name in ("draft", "smollm2-draft"):
        engine = DraftEngine(DraftConfig(model=str(ROOT / "models" / name), device=plan.device,
                                         dtype=plan.stack_dtype, kv_blocks=1024, threads=1))
        offs, ons = [], []
        for _ in range(3):
            off, _ = engine.offload()
            on, _ = engine.reload()
            offs.append(off)
            ons.append(on)
        weights = offs[0].weight_bytes
        row = {"draft": name, "weights_mb": round(weights / 2**20, 2),
               "offload_ms": round(statistics.median(r.seconds for r in offs) * 1e3, 3),
               "reload_ms": round(statistics.median(r.seconds for r in ons) * 1e3, 3)}
        row["reload_gb_s"] = round(weights / 2**30 / (row["reload_ms"] / 1e3), 2) if row["reload_ms"] else None
        rows.append(row)
        print("  offload", row, flush=True)
        del engine
    return rows


# ---- 4. the stack, and transformers on the same device -------------------------------------------------------

def _prompts(n: int) -> list[str]:
    lines = (ROOT / "bench" / "workloads" / "short.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def _get(url: str, path: str) -> dict:
    import httpx

    return dict(httpx.get(url + path, timeout=30).json())


def _admissions(url: str) -> dict[str, float]:
    """specserve:admission_total by outcome (declined, best_effort, refused), summed over tiers."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if family.name == "specserve:admission":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["outcome"]] = out.get(sample.labels["outcome"], 0) + sample.value
    return out


def _texts(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    import httpx

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            async def one(p: str) -> str:
                r = await c.post("/v1/completions", json={"model": "target", "prompt": p, "max_tokens": max_tokens,
                                                           "temperature": 0})
                r.raise_for_status()
                return str(r.json()["choices"][0]["text"])
            return list(await asyncio.gather(*(one(p) for p in prompts)))
    return asyncio.run(run())


def stack(plan: Plan, work: Path) -> dict:
    from bench.sweep import bench_point
    from specserve.shared.host.launch import ServiceProcess
    from tests.support.procs import Up, gateway

    profile = work / "profile.json"
    first, *others = plan.policies
    up = Up("--device", plan.device, "--dtype", plan.stack_dtype, "--policy", first, "--profile", str(profile),
            timeout_s=900)

    def started(policy: str) -> ServiceProcess:  # NAME@fifo: that policy with FIFO admission
        name, _, admission = policy.partition("@")
        return gateway(up, name, "--profile", str(profile), *(["--admission", admission] if admission else []))

    gateways: dict[str, ServiceProcess] = {}
    out: dict = {"runs": [], "lossless": {}}
    try:  # a gateway that fails to start still stops `up` and the gateways before it
        gateways.update((p, started(p)) for p in others)
        urls = {first: up.url, **{p: g.address for p, g in gateways.items()}}
        out["profile"] = json.loads(profile.read_text())
        out["classes"] = {p: _get(url, "/v1/slo_classes") for p, url in urls.items()}
        prompts = _prompts(plan.lossless_prompts)
        texts = {p: _texts(url, prompts, plan.stack_tokens) for p, url in urls.items()}
        for p in urls:
            out["lossless"][p] = sum(a == b for a, b in zip(texts[p], texts["none"]))
        out["lossless_of"] = len(prompts)
        out["texts_none"] = texts["none"]
        for c in plan.concurrency:
            for p, url in urls.items():  # untimed: a shape's first pass captures its graphs (target and draft)
                bench_point(url, work / f"warm-{p.replace(':', '')}-{c}.jsonl", f"{p} c{c} warm-up", num_requests=c,
                            max_concurrency=c, max_tokens=plan.stack_tokens, mix=STACK_MIX, best_effort=True,
                            sequential_prompts=True, seed=1)
            for p, url in urls.items():
                before = _admissions(url)
                s = bench_point(url, work / f"{p.replace(':', '')}-{c}.jsonl", f"{p} c{c}",
                                num_requests=plan.requests(c), max_concurrency=c, max_tokens=plan.stack_tokens,
                                mix=STACK_MIX, best_effort=True, sequential_prompts=True, seed=0)
                after = _admissions(url)
                row = {"policy": p, "concurrency": c, "requests": s["requests"], "errors": s["errors"],
                       "error_kinds": s["error_kinds"],
                       "tokens_per_s": s["throughput_tok_s"], "ttft_p50_ms": s["ttft_p50_ms"],
                       "tpot_p50_ms": s["tpot_p50_ms"], "tokens_per_step": s["tokens_per_step"],
                       "admission": {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)},
                       # where an iteration's time went: the draft and target calls, transport, the gateway's own
                       "iteration_ms": s["iteration"].get("mean_ms"),
                       "iteration_ms_by_part": {k: round(v * 1e3 / max(1, s["iteration"]["iterations"]), 3)
                                                for k, v in s["iteration"].get("seconds", {}).items()}}
                out["runs"].append(row)
                print("  stack", row, flush=True)
        out["cost_error"] = {p: _get(url, "/v1/slo_classes").get("cost_error") for p, url in urls.items()}
    finally:
        for g in gateways.values():
            g.stop()
        up.interrupt()
    out["transformers"] = transformers_generate(plan, out["texts_none"])
    return out


def overhead(plan: Plan) -> dict[str, dict]:
    """bench/step_overhead.py's part 1 on the device: the near-null target (the demo draft served as the
    target) under `none` at each number in flight, and the default at the largest below 100, each without and
    with `--async-scheduling`, and both with a loose chat SLO; per mode the iteration, the target's pass and
    the rest (the stack's own), ms per iteration, and tokens/s."""
    from bench.step_overhead import near_null

    args = argparse.Namespace(rounds=1, seconds=plan.overhead_seconds)
    row = near_null(args, list(plan.overhead_inflight), ("--device", plan.device, "--dtype", plan.stack_dtype))[0]
    keep = ("inflight", "iterations", "iteration_ms", "target_ms", "stack_ms", "stack_us_per_request",
            "target_service_ms", "tokens_per_s", "split_ms")
    return {mode: {k: v[k] for k in keep} for mode, v in row.items()}


def transformers_generate(plan: Plan, texts_none: list[str]) -> list[dict]:
    """transformers `generate` on the same device and dtype, a batch of `concurrency` short prompts
    (left-padded), the same number of tokens; its batch-1 texts against `none`'s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = ROOT / "models" / "target"
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, plan.stack_dtype)).to(plan.device)
    hf.eval()
    rows = []
    for c in plan.concurrency:
        prompts = (_prompts(max(c, 8)) * 8)[:c]
        enc = tok(prompts, return_tensors="pt", padding=True).to(plan.device)
        walls = []
        for _ in range(3 if c > 1 else 2):
            sync(plan.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                hf.generate(**enc, max_new_tokens=plan.stack_tokens, min_new_tokens=plan.stack_tokens,
                                  do_sample=False, pad_token_id=tok.pad_token_id)
            sync(plan.device)
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls[1:])
        row = {"policy": "transformers generate", "concurrency": c, "tokens_per_s": c * plan.stack_tokens / wall,
               "wall_per_token_ms": wall / plan.stack_tokens * 1e3}
        if c == 1:
            alone = []
            for p in _prompts(len(texts_none)):
                ids = tok(p, return_tensors="pt").to(plan.device)
                with torch.inference_mode():
                    g = hf.generate(**ids, max_new_tokens=plan.stack_tokens, do_sample=False,
                                    pad_token_id=tok.pad_token_id)
                alone.append(tok.decode(g[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
            row["equal_to_none"] = sum(a == b for a, b in zip(alone, texts_none))
        rows.append(row)
        print("  transformers", row, flush=True)
    return rows


# ---- 5. a simulator preset from this device's passes -------------------------------------------------------

def sim(plan: Plan, work: Path, real: dict | None) -> dict:
    from bench.sim_fit_latency import fit, grid, measure
    from bench.sweep import bench_point
    from specserve.shared.simulate.preset import load_preset
    from tests.support.procs import Up

    dry = plan.device == "cpu"
    fitted: dict[str, Any] = {}
    for name in ("target", "draft"):
        runner = ModelRunner.from_dir(ROOT / "models" / name, num_blocks=4096, dtype=plan.stack_dtype,
                                      device=plan.device, kernels="auto")
        if name == "target" and runner.inputs_for == "triton":
            runner.use_graphs(capture=plan.device.startswith("cuda"))  # as the target service runs it
        passes = (grid((1, 2, 4), (1, 4), (16,)) if dry else grid((1, 4, 16, 32, 64), (1, 2, 4, 8), (64, 512)))
        points = measure(None, passes, plan.reps, runner, lambda: sync(plan.device))
        model = fit(points)
        fitted[name] = {"tokens": list(model.tokens), "ms": list(model.ms), "per_request_ms": model.per_request_ms,
                        "per_context_token_us": model.per_context_token_us, "per_pair_ns": model.per_pair_ns,
                        "points": points}
        del runner
    preset = work / "gpu-demo.toml"
    preset.write_text(_preset_toml(plan, fitted))
    load_preset(str(preset))  # it parses
    out: dict[str, Any] = {"preset": preset.read_text(), "fitted": fitted}
    if real is None:
        out["error_vs_real"] = None
        return out
    c = plan.sim_concurrency
    # the real stack's profile: the same budget B and SLO classes on both sides (as bench/sim_fidelity.py)
    up = Up("--simulate", str(preset), "--policy", plan.policies[0], "--profile", str(work / "profile.json"),
            timeout_s=300)
    try:
        s = bench_point(up.url, work / f"sim-{c}.jsonl", f"sim c{c}", num_requests=plan.requests(c), max_concurrency=c,
                        max_tokens=plan.stack_tokens, mix=STACK_MIX, best_effort=True, sequential_prompts=True,
                        seed=0)
    finally:
        up.interrupt()
    measured = next(r for r in real["runs"] if r["policy"] == plan.policies[0] and r["concurrency"] == c)
    simulated = {"tokens_per_s": s["throughput_tok_s"], "ttft_p50_ms": s["ttft_p50_ms"],
                 "tpot_p50_ms": s["tpot_p50_ms"], "tokens_per_step": s["tokens_per_step"]}
    out["simulated"] = simulated
    out["real"] = measured
    out["error_vs_real"] = {k: (round(simulated[k] / measured[k] - 1, 3) if simulated[k] and measured[k] else None)
                            for k in simulated}
    print("  sim", out["error_vs_real"], flush=True)
    return out


def _preset_toml(plan: Plan, fitted: dict[str, Any]) -> str:
    import tomllib

    base = tomllib.loads((ROOT / "shared" / "simulate" / "presets" / "cpu-demo.toml").read_text())
    device = torch.cuda.get_device_name() if plan.device.startswith("cuda") else platform.processor() or "cpu"
    acc = base["acceptance"]
    lines = ['name = "gpu-demo"',
             f'description = "bundled demo pair on {device}, {plan.stack_dtype} (fitted by bench/gpu_suite.py)"',
             "sources = [", f'  "latency: bench/gpu_suite.py, passes of the demo pair on {device}",',
             '  "acceptance: the cpu-demo preset (the same pair)",', "]", ""]
    for name in ("target", "draft"):
        f = fitted[name]
        lines += [f"[{name}]", f"tokens = {f['tokens']}", f"ms = {[round(v, 4) for v in f['ms']]}",
                  f"per_request_ms = {f['per_request_ms']}", f"per_context_token_us = {f['per_context_token_us']}",
                  f"per_pair_ns = {f['per_pair_ns']}", "padded_attention = false", ""]
    lines += ["[acceptance]", f"depth_accept = {acc['depth_accept']}", f"rank_tail = {acc['rank_tail']}",
              f"concentration = {acc['concentration']}", "", "[text]",
              "corpus = [" + ", ".join(json.dumps(c) for c in base["text"]["corpus"]) + "]",
              f'tokenizer = {json.dumps(base["text"]["tokenizer"])}', f"seed = {base['text']['seed']}", ""]
    return "\n".join(lines)


# ---- the report ------------------------------------------------------------------------------------------------

def environment(plan: Plan) -> dict:
    import transformers

    env = {"device": plan.device, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if plan.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    return env


def _tile1(row: dict) -> str:
    """A tree point's time with one token a program, and how much slower than the tiled kernel."""
    return f"{row['triton_tile1']} ({row['tile_vs_tile1']}x)" if "triton_tile1" in row else "-"


def markdown(report: dict) -> str:
    env = report["environment"]
    dry = " (DRY RUN on CPU: plumbing only, no figure here is a GPU measurement)" if report["dry_run"] else ""
    lines = [f"# GPU suite: {env.get('gpu', env['device'])}{dry}",
             "", f"torch {env['torch']}, transformers {env['transformers']}, triton {env['triton']}, {env['date']}; "
             f"sections: " + ", ".join(f"{k} {v['seconds']:.0f} s" + (" FAILED" if v.get("error") else "")
                                      for k, v in report["sections"].items()), ""]
    for name, sec in report["sections"].items():
        if sec.get("error"):
            lines += [f"## {name}: failed", "", "```", sec["error"].strip()[-2000:], "```", ""]
    par = report["sections"].get("parity", {}).get("result")
    if par:
        lines += ["## Parity with transformers", "", "| model | prompt | dtype | attention | CUDA graphs "
                  "| max abs logit diff | greedy equal | first difference (their top-2 gap) |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['prompt']} | {r['dtype']} | {r['attention']} | {r['graphs']} | "
                  f"{r['max_abs_logit_diff']:.3g} | {r['greedy_equal']} | "
                  + ("-" if r["first_difference"] is None else
                     f"token {r['first_difference']} ({r['their_top2_gap']:.3g})") + " |" for r in par]
        lines.append("")
    bits = report["sections"].get("bits", {}).get("result")
    if bits:
        lines += ["## The Triton kernel's bits on the device (random inputs)", "",
                  "| shape | dtype | tokens | every tiling the same bits | chain = its tokens decoded | max abs diff "
                  "from the torch reference |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['dtype']} | {r['tokens']} | {r['tiles_equal']} | {r['chain_equals_decoded']} "
                  f"| {r['max_abs_diff_vs_reference']:.3g} |" for r in bits]
        lines.append("")
    cur = report["sections"].get("curves", {}).get("result")
    if cur:
        lines += ["## Pass time (ms, median), random weights", ""]
        for shape, rows in cur.items():
            lines += [f"### {shape}", "", "| pass | requests | nodes | context | SDPA | Triton | Triton + graphs "
                      "| SDPA/Triton | Triton/graphs | Triton, 1 token a program (its time / tiled) |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r['kind']} | {r['requests']} | {r['nodes']} | {r['context']} | {r['sdpa']} | {r['triton']} "
                      f"| {r['graphs'] if r['graphs'] is not None else '(eager)'} | {r['triton_vs_sdpa']}x | "
                      f"{str(r.get('graphs_vs_triton', '-')) + 'x' if r.get('graphs_vs_triton') else '-'} | "
                      f"{_tile1(r)} |" for r in rows]
            lines.append("")
    ipc_rows = report["sections"].get("ipc", {}).get("result")
    if ipc_rows:
        lines += ["## Draft -> target transfer (round trip, ms)", "", "| path | tokens x width | MB | ms |",
                  "|---|---|---|---|"]
        lines += [f"| {r['path']} | skipped: {r['skipped']} | | |" if "skipped" in r else
                  f"| {r['path']} | {r['tokens']} x {r['width']} | {r['mb']} | {r['round_trip_ms']} |"
                  for r in ipc_rows]
        lines.append("")
    off = report["sections"].get("offload", {}).get("result")
    if off:
        lines += ["## The draft offloaded to host memory and back (median of 3)", "",
                  "| draft | weights MB | offload ms | reload ms | reload GB/s |", "|---|---|---|---|---|"]
        lines += [f"| {r['draft']} | {r['weights_mb']} | {r['offload_ms']} | {r['reload_ms']} | {r['reload_gb_s']} |"
                  for r in off]
        lines.append("")
    st = report["sections"].get("stack", {}).get("result")
    if st:
        lines += ["## `specserve up` on the device against transformers `generate`", "",
                  "Greedy texts equal to `none`'s: " + ", ".join(f"{p} {n}/{st['lossless_of']}"
                                                                for p, n in st["lossless"].items()), "",
                  "| policy | in flight | tokens/s | TTFT p50 ms | TPOT p50 ms | tokens per step | admission "
                  "| iteration ms (draft / target / transport / schedule) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in st["runs"]:
            adm = ", ".join(f"{k} {v:.0f}" for k, v in r.get("admission", {}).items()) or "-"
            parts = r.get("iteration_ms_by_part", {})
            split = " / ".join(_f(parts.get(k)) for k in ("draft", "target", "transport", "schedule"))
            it = f"{_f(r.get('iteration_ms'))} ({split})" if parts else "-"
            lines.append(f"| {r['policy']} | {r['concurrency']} | {_f(r['tokens_per_s'])} | {_f(r['ttft_p50_ms'])} | "
                         f"{_f(r['tpot_p50_ms'])} | {_f(r['tokens_per_step'])} | {adm} | {it} |")
        for r in st["transformers"]:
            lines.append(f"| transformers generate | {r['concurrency']} | {_f(r['tokens_per_s'])} | | "
                         f"(wall per token {_f(r['wall_per_token_ms'])}) | | | |")
        if st.get("profile"):
            pr = st["profile"]
            chat = next(iter(st.get("classes", {}).values()), {}).get("classes", {}).get("chat", {})
            lines += ["", f"Profile: baseline iteration {pr['baseline_iteration_ms']} ms, B = {pr['budget_tokens']} "
                      f"tokens; the chat tier's TPOT SLO {chat.get('tpot_ms')} ms (8x the baseline). "
                      "`admission`: specserve:admission_total during the run (declined, best_effort, refused)."]
        lines.append("")
    ov = report["sections"].get("overhead", {}).get("result")
    if ov:
        lines += ["## The stack's own time: the near-null target (the demo draft as the target)", "",
                  "| policy @ in flight | iteration ms | target pass ms | stack ms (the rest) | stack us a request "
                  "| tokens/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {mode} | {_f(r['iteration_ms'])} | {_f(r['target_ms'])} | {_f(r['stack_ms'])} | "
                  f"{_f(r['stack_us_per_request'])} | {_f(r['tokens_per_s'])} |" for mode, r in ov.items()]
        lines.append("")
    sm = report["sections"].get("sim", {}).get("result")
    if sm and sm.get("error_vs_real"):
        lines += [f"## Simulator (preset fitted here) against the real stack at {report['plan']['sim_concurrency']} "
                  "in flight", "", "| metric | real | simulated | error |", "|---|---|---|---|"]
        lines += [f"| {k} | {_f(sm['real'][k])} | {_f(sm['simulated'][k])} | {e} |"
                  for k, e in sm["error_vs_real"].items()]
        lines.append("")
    return "\n".join(lines) + "\n"


def portable(text: str, work: Path) -> str:
    """The report without this machine's paths: the checkout's relative to it, the run's scratch folder as
    <work>, the standard library's as <stdlib> (tracebacks, the profile's model and path)."""
    return (text.replace(str(ROOT) + "/", "").replace(str(work), "<work>")
            .replace(sysconfig.get_paths()["stdlib"], "<stdlib>"))


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every section on CPU at tiny sizes (minutes)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results" / "gpu_suite"))
    ap.add_argument("--sections", default="parity,bits,curves,ipc,offload,stack,overhead,sim",
                    help="comma-separated, in order")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--policies", help="the stack's gateways, comma-separated (NAME@fifo: FIFO admission); "
                                       "`none` among them (default: joint,none,chain:4,none@fifo)")
    ap.add_argument("--concurrency", help="the stack's requests in flight, comma-separated (default: 1,16,64)")
    ap.add_argument("--echo-server", help=argparse.SUPPRESS)  # section 3's receiving process
    ap.add_argument("--ipc", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.echo_server:
        asyncio.run(_echo_server(args.echo_server, args.ipc, args.device))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device here: run it on a GPU, or with --dry-run")
    os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))  # every RPC link and service started here
    from specserve.shared.runtime.model_store import unpack_bundled

    unpack_bundled()
    plan = dry_plan() if args.dry_run else Plan(device=args.device)
    if args.policies:
        plan.policies = tuple(args.policies.split(","))
    if args.concurrency:
        plan.concurrency = tuple(int(c) for c in args.concurrency.split(","))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_suite-"))
    report: dict[str, Any] = {"dry_run": args.dry_run, "environment": environment(plan), "plan": asdict(plan),
                              "sections": {}}
    steps: dict[str, Callable[[], Any]] = {
        "parity": lambda: parity(plan), "bits": lambda: kernel_bits(plan), "curves": lambda: curves(plan),
        "ipc": lambda: ipc(plan),
        "offload": lambda: offload(plan),
        "stack": lambda: stack(plan, work), "overhead": lambda: overhead(plan),
        "sim": lambda: sim(plan, work, report["sections"].get("stack", {}).get("result")),
    }
    t_all = time.perf_counter()
    for name in args.sections.split(","):
        print(f"[gpu_suite] {name} ...", flush=True)
        t0 = time.perf_counter()
        entry: dict[str, Any] = {}
        try:
            entry["result"] = steps[name]()
        except Exception:
            entry["error"] = traceback.format_exc()
            print(entry["error"], file=sys.stderr, flush=True)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        report["sections"][name] = entry
        (out_dir / "gpu_suite.json").write_text(portable(json.dumps(report, indent=1, default=str) + "\n", work))
        (out_dir / "gpu_suite.md").write_text(portable(markdown(report), work))
    print(f"[gpu_suite] done in {time.perf_counter() - t_all:.0f} s: {out_dir / 'gpu_suite.md'}", flush=True)
    return 1 if any("error" in s for s in report["sections"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
