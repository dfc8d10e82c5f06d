"""The runtime's CUDA paths, checked on a GPU: passes against transformers, CUDA-graph beam steps against eager.

    python bench/cuda_smoke.py [--device cuda] [--out FILE]

Needs only torch, transformers, safetensors and numpy (no service, no socket), so it runs on a GPU
machine that has those, with this checkout on PYTHONPATH as the `specserve` package (services/ as
`specserve`, shared/ as `specserve.shared`). On the bundled demo pair:
1. **Parity**, per dtype (float32, bfloat16, float16): a 64-token prompt prefilled by our
   `ModelRunner` and by transformers on the same device and dtype: the largest |logit difference|
   at the prompt's last position; then 32 greedy tokens from each (our decode loop, transformers
   `generate`): equal or not.
2. **The draft's CUDA-graph beam steps** (`services/draft/static_step.py`), float32: the trees of
   `beam_search` with graphs (captured on first use) against eager, for 5 requests at depth 4 and
   width 3; then the median wall time of one `beam_search` call (depth 4, width 3, after warm-up, 20
   calls) eager and replayed, at 1, 4 and 8 requests, and the first call's time (capture included).
3. With `--stack` (msgspec and opentelemetry needed too): `specserve up --device cuda` on the demo
   pair, a gateway per policy (none, chain:4, adaserve, turbospec, joint) on its services; 8 prompts,
   48 greedy tokens each, one at a time and then 8 at once, through the OpenAI API over HTTP: every
   policy's texts against `none`'s, and `none`'s against transformers `generate` on the same device.
Writes the figures as JSON (--out) and prints them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS, NEW_TOKENS, BLOCKS = 64, 32, 512


def parity(device: str, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    from specserve.shared.runtime.batch import Chunk
    from specserve.shared.runtime.runner import ModelRunner

    model_dir = ROOT / "models" / "target"
    runner = ModelRunner.from_dir(model_dir, num_blocks=BLOCKS, dtype=dtype, device=device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    rng = random.Random(0)
    prompt = [rng.randrange(3, runner.vocab_size) for _ in range(PROMPT_TOKENS)]
    ours = runner.forward([Chunk("p", prompt, logits_at=[PROMPT_TOKENS - 1])])[0][0]
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        theirs = hf(ids).logits[0, -1].float()
        gen = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    hf_tokens = gen[0, PROMPT_TOKENS:].tolist()
    tokens = [int(ours.argmax())]
    while len(tokens) < NEW_TOKENS:
        tokens.append(int(runner.forward([Chunk("p", [tokens[-1]], logits_at=[0])])[0][0].argmax()))
    return {"max_abs_logit_diff": float((ours - theirs).abs().max()), "greedy_equal": tokens == hf_tokens,
            "first_difference": next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), None)}


def beam_steps(device: str) -> dict:
    from specserve.draft.beam import BeamRequest, beam_search
    from specserve.draft.static_step import StaticBeamStep
    from specserve.shared.runtime.batch import Chunk
    from specserve.shared.runtime.runner import ModelRunner

    rng = random.Random(1)

    def setup(n: int, graphs: bool | None):
        runner = ModelRunner.from_dir(ROOT / "models" / "draft", num_blocks=BLOCKS, device=device)
        step = None if graphs is None else StaticBeamStep(runner, use_graphs=graphs)
        contexts = {f"r{i}": [rng.randrange(3, runner.vocab_size) for _ in range(rng.randint(8, 40))]
                    for i in range(n)}
        logits = runner.forward([Chunk(rid, t, logits_at=[len(t) - 1]) for rid, t in contexts.items()])
        return runner, step, [BeamRequest(rid, t[-1], lg[0], 4, 3) for (rid, t), lg in zip(contexts.items(), logits)]

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    state = rng.getstate()
    runner, _, reqs = setup(5, None)
    eager, _ = beam_search(runner, reqs)
    rng.setstate(state)
    runner, step, reqs = setup(5, True)
    graphed, _ = beam_search(runner, reqs, step)
    same = all(eager[r].tokens == graphed[r].tokens and eager[r].parents == graphed[r].parents for r in eager)
    logp = max(abs(a - b) for r in eager for a, b in zip(eager[r].logp, graphed[r].logp))
    out: dict = {"trees_equal": same, "max_abs_logp_diff": logp, "graphs_used": bool(step and step.use_graphs),
                 "ms_per_call": {}}
    for n in (1, 4, 8):
        row = {}
        for name, graphs in (("eager", None), ("graphs", True)):
            runner, step, reqs = setup(n, graphs)
            sync()
            t0 = time.perf_counter()
            beam_search(runner, reqs, step)
            sync()
            row[f"{name}_first_ms"] = (time.perf_counter() - t0) * 1e3
            times = []
            for _ in range(20):
                sync()
                t0 = time.perf_counter()
                beam_search(runner, reqs, step)
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            row[f"{name}_ms"] = statistics.median(times)
        row["speedup"] = row["eager_ms"] / row["graphs_ms"]
        out["ms_per_call"][str(n)] = row
    return out


def stack(device: str) -> dict:
    import asyncio
    import os
    import secrets
    import tempfile

    import httpx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from tests.support.procs import Up, gateway

    os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))
    lines = (ROOT / "bench" / "workloads" / "short.jsonl").read_text().splitlines()[:8]
    prompts = [json.loads(line)["prompt"] for line in lines]
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "target")
    hf = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "target", dtype=torch.float32).to(device).eval()
    reference = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"].to(device)
        with torch.inference_mode():
            gen = hf.generate(ids, max_new_tokens=48, do_sample=False)
        reference.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))

    async def serve(url: str) -> tuple[list[str], list[str], float]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            async def one(p: str) -> str:
                r = await c.post("/v1/completions", json={"model": "target", "prompt": p, "max_tokens": 48,
                                                           "temperature": 0})
                r.raise_for_status()
                return r.json()["choices"][0]["text"]
            t0 = time.perf_counter()
            alone = [await one(p) for p in prompts]
            wall = time.perf_counter() - t0
            together = list(await asyncio.gather(*(one(p) for p in prompts)))
        return alone, together, wall

    profile = Path(tempfile.mkdtemp()) / "profile.json"
    up = Up("--device", device, "--policy", "none", "--profile", str(profile), timeout_s=600)
    out: dict = {}
    try:
        for policy in ("none", "chain:4", "adaserve", "turbospec", "joint"):
            g = None if policy == "none" else gateway(up, policy, "--profile", str(profile))
            try:
                alone, together, wall = asyncio.run(serve(up.url if g is None else g.address))
            finally:
                if g is not None:
                    g.stop()
            out[policy] = {"alone_equal_none": None, "together_equal_none": None,
                           "equal_transformers": sum(a == b for a, b in zip(alone, reference)),
                           "s_one_at_a_time": wall, "alone": alone, "together": together}
            print(policy, f"{sum(a == b for a, b in zip(alone, reference))}/8 equal to transformers, "
                  f"{wall:.2f} s one at a time", flush=True)
    finally:
        up.interrupt()
    for row in out.values():
        row["alone_equal_none"] = sum(a == b for a, b in zip(row["alone"], out["none"]["alone"]))
        row["together_equal_none"] = sum(a == b for a, b in zip(row["together"], out["none"]["alone"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--stack", action="store_true", help="also the services and gateways on the device")
    args = ap.parse_args(argv)
    result: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                    "torch": torch.__version__, "parity": {}}
    for dtype in ("float32", "bfloat16", "float16"):
        result["parity"][dtype] = parity(args.device, dtype)
        print(dtype, result["parity"][dtype], flush=True)
    result["beam_steps"] = beam_steps(args.device)
    print(json.dumps(result["beam_steps"], indent=1), flush=True)
    if args.stack:
        result["stack"] = stack(args.device)
        print(json.dumps({p: {k: v for k, v in r.items() if k not in ("alone", "together")}
                          for p, r in result["stack"].items()}, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
