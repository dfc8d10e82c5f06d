"""One decode pass against the floor its weights set, and what `torch.compile` makes of it.

    .venv/bin/python bench/decode_floor.py --rounds 3 [--models models/target,smollm2-135m-instruct]
        [--steps 120] [--out bench/results/decode_floor.json]

At concurrency 1 a decode pass multiplies one token's activations by every weight matrix once, so a
pass cannot run faster than streaming the weights from memory. Per model (a directory or a named
model), float32, one torch thread, 64-token prompt, then --steps greedy one-token decodes (the first
20 dropped as warm-up), in interleaved rounds:
- `linears`: only the pass's matrix products: every nn.Linear of our model (the tied LM head
  included) applied to one token's activations, one after another (the floor for the rest);
- `eager`: our runtime's decode pass (`ModelRunner.forward`, paged KV, no draft), as the target
  service runs it;
- `compiled`: the same pass with each layer's dense parts (RMSNorm, the fused projections, RoPE,
  the output projection and the MLP) under `torch.compile(dynamic=True)`; the paged attention stays
  eager. Its compile time (in this process, cache warm or cold as found) is reported;
- `hf`: transformers' own forward at one token with its KV cache (`model(ids, past_key_values=...)`),
  the model call inside each step of `generate`.
Reported per model and mode: the median over rounds of each round's median ms per decode, with
min-max; and for `compiled` the largest |logit difference| from `eager` over the steps, and whether
the greedy tokens were the same.

Figures: docs/lab/decode_floor.md, "A compiled decode".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.sweep import spread  # noqa: E402

PROMPT = list(range(5, 69))
MODES = ["linears", "eager", "compiled", "hf"]


def compile_layers(model) -> None:
    """Put each decoder layer's dense parts under torch.compile (the paged attention stays eager); the
    compile itself happens in the first pass, which the caller times."""
    import torch

    from specserve.shared.runtime import model as M

    def before_attention(attn, norm, x, cos, sin):
        t = x.shape[0]
        qk, v = attn.qkv_proj(norm(x)).split((attn.q_size + attn.kv_size, attn.kv_size), dim=-1)
        qk = M.apply_rotary(qk.view(t, attn.num_heads + attn.num_kv_heads, attn.head_dim), cos, sin)
        q, k = qk.split((attn.num_heads, attn.num_kv_heads), dim=1)
        return q, k, v.view(t, attn.num_kv_heads, attn.head_dim)

    def after_attention(layer, x, out):
        x = x + layer.self_attn.o_proj(out.reshape(x.shape[0], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    pre = torch.compile(before_attention, dynamic=True)
    post = torch.compile(after_attention, dynamic=True)

    def forward(layer, x, cos, sin, kv_cache, meta):
        attn = layer.self_attn
        q, k, v = pre(attn, layer.input_layernorm, x, cos, sin)
        return post(layer, x, M.paged_attention(q, k, v, attn.layer, kv_cache, meta, attn.window))

    for layer in model.model.layers:
        layer.forward = forward.__get__(layer)


def run_ours(model_dir: str, steps: int, compiled: bool) -> dict:
    from specserve.shared.runtime.batch import Chunk
    from specserve.shared.runtime.runner import ModelRunner

    runner = ModelRunner.from_dir(model_dir, num_blocks=64)
    if compiled:
        compile_layers(runner.model)
    t0 = time.perf_counter()
    out = runner.forward([Chunk("r", PROMPT, logits_at=[len(PROMPT) - 1])])
    first = time.perf_counter() - t0
    times, logits = [], []
    token = int(out[0].argmax())
    for _ in range(steps):
        start = time.perf_counter()
        out = runner.forward([Chunk("r", [token], logits_at=[0])])
        times.append(time.perf_counter() - start)
        logits.append(out[0][0])
        token = int(out[0].argmax())
    return {"ms": statistics.median(times[20:]) * 1e3, "first_pass_s": first, "logits": logits}


def run_linears(model_dir: str, steps: int) -> dict:
    import torch

    from specserve.shared.runtime.runner import ModelRunner

    linears = [m for m in ModelRunner.from_dir(model_dir, num_blocks=4).model.modules()
               if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, m.in_features) for m in linears]
    times = []
    with torch.inference_mode():
        for _ in range(steps):
            start = time.perf_counter()
            for m, x in zip(linears, inputs):
                m(x)
            times.append(time.perf_counter() - start)
    return {"ms": statistics.median(times[20:]) * 1e3,
            "weights_mb": sum(m.weight.numel() * m.weight.element_size() for m in linears) / 2**20}


def run_hf(model_dir: str, steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    times = []
    with torch.inference_mode():
        out = hf(torch.tensor([PROMPT]), use_cache=True)
        past, token = out.past_key_values, out.logits[0, -1].argmax()
        for _ in range(steps):
            start = time.perf_counter()
            out = hf(token.view(1, 1), past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - start)
            past, token = out.past_key_values, out.logits[0, -1].argmax()
    return {"ms": statistics.median(times[20:]) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--models", default="models/target,smollm2-135m-instruct",
                    help="comma-separated model directories or named models")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_floor.json"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps <= 20:
        ap.error("--rounds must be >= 1 and --steps > 20")

    import torch

    from specserve.shared.runtime.model_store import resolve

    torch.set_num_threads(1)
    models = {name: str(resolve(name)) for name in args.models.split(",")}
    rounds: list[dict] = []
    for r in range(args.rounds):
        row: dict = {}
        for name, path in models.items():
            eager = run_ours(path, args.steps, compiled=False)
            compiled = run_ours(path, args.steps, compiled=True)
            diff = max(float((a - b).abs().max()) for a, b in zip(eager["logits"], compiled["logits"]))
            same = all(int(a.argmax()) == int(b.argmax()) for a, b in zip(eager["logits"], compiled["logits"]))
            row[name] = {"linears": run_linears(path, args.steps), "hf": run_hf(path, args.steps),
                         "eager": {"ms": eager["ms"]},
                         "compiled": {"ms": compiled["ms"], "first_pass_s": compiled["first_pass_s"],
                                      "max_abs_logit_diff": diff, "same_tokens": same}}
            print(f"round {r + 1} {name}: " + ", ".join(f"{m} {row[name][m]['ms']:.2f} ms" for m in MODES)
                  + f"; compile {compiled['first_pass_s']:.1f} s, max |diff| {diff:.2e}, same tokens {same}",
                  flush=True)
        rounds.append(row)
    summary = {name: {mode: spread([rd[name][mode]["ms"] for rd in rounds]) for mode in MODES} for name in models}
    out = {"meta": {"rounds": args.rounds, "steps": args.steps, "threads": 1, "dtype": "float32",
                    "prompt_tokens": len(PROMPT), "cpu_count": os.cpu_count(), "torch": torch.__version__},
           "rounds": rounds, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("\n| model | linears only (floor) | eager (ours) | compiled layers (ours) | transformers forward |")
    print("|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | " + " | ".join(f"{s[m]['median']:.2f} ({s[m]['min']:.2f}-{s[m]['max']:.2f})"
                                          for m in MODES) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
