"""How often SmolLM2-135M-Instruct's compiled pass picks the same greedy token on int8 activations as on
float32 ones, under teacher forcing.

    .venv/bin/python bench/int8_agreement.py [--prompts 64] [--tokens 32] [--out FILE]

The prompts: the first --prompts held-out chat prompts of the SmolLM2 draft's training set
(training/smollm2_prompts.py: template x topic, bucket 0 of 10 of their hash, never trained on), each
under the model's chat template. Per prompt, the float32 pass (model.gguf's blocks, float32
activations) decodes --tokens greedy tokens; then prompt + continuation goes through one pass in each
mode, with logits at every continuation position. Reported: the fraction of positions where the int8
pass's argmax equals the float32 pass's (teacher forcing: both see the float32 continuation), per
prompt and overall, and the largest logit difference relative to the logits' scale. Where
llama-cpp-python is installed (an optional package), the same for llama.cpp on the same file
(`llama_cpp` in the output): its own agreement with the float32 pass, the figure to read beside ours.
Figures: docs/lab/cpu_pass.md ("int8 activations").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def held_out_prompts(count: int) -> list[str]:
    """The first `count` held-out template x topic prompts, in the lists' order."""
    from training.smollm2_prompts import TEMPLATES, TOPICS, held_out

    prompts = [tpl.format(t=topic) for tpl in TEMPLATES for topic in TOPICS]
    return [p for p in prompts if held_out(p)][:count]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "int8_agreement.json"))
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from specserve.shared.runtime import kernels
    from specserve.shared.runtime.batch import Chunk
    from specserve.shared.runtime.generate import generate
    from specserve.shared.runtime.model_store import resolve
    from specserve.shared.runtime.runner import ModelRunner

    assert kernels.load(), kernels.error()
    model_dir = resolve("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = held_out_prompts(args.prompts)
    ids = {}
    for i, text in enumerate(texts):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids[f"p{i}"] = list(chat["input_ids"] if not isinstance(chat, list) else chat)
    runner = ModelRunner.from_dir(model_dir, num_blocks=1024, kernels="cpu", activations="float32")
    continuations = generate(runner, ids, max_new_tokens=args.tokens)
    llm = _llama_cpp(Path(model_dir) / "model.gguf")

    per_prompt, worst, theirs = [], 0.0, []
    for rid, prompt in ids.items():
        seq = prompt + continuations[rid]
        at = range(len(prompt) - 1, len(seq) - 1)  # the logits that predict each continuation token
        logits = {}
        for mode in ("float32", "int8"):
            runner.model.activations = mode
            (logits[mode],) = runner.forward([Chunk(rid, seq, logits_at=at)])
            runner.release(rid)
        same = (logits["int8"].argmax(-1) == logits["float32"].argmax(-1)).float()
        if llm is not None:
            llm.reset()
            llm.eval(seq)
            picked = torch.tensor([int(llm.scores[p].argmax()) for p in at])
            theirs.append((picked == logits["float32"].argmax(-1)).float().mean().item())
        assert torch.equal(logits["float32"].argmax(-1), torch.tensor(continuations[rid]))  # batch invariance
        per_prompt.append(same.mean().item())
        scale = logits["float32"].abs().max().item()
        worst = max(worst, (logits["int8"] - logits["float32"]).abs().max().item() / scale)
        runner.model.activations = "float32"

    positions = len(ids) * args.tokens
    agree = statistics.fmean(per_prompt)
    out = {"meta": {"prompts": len(ids), "tokens": args.tokens, "positions": positions,
                    "int8_variant": torch.ops.specserve_cpu.int8_variant()},
           "agreement": agree, "prompts_all_equal": sum(p == 1.0 for p in per_prompt),
           "min_prompt_agreement": min(per_prompt), "max_logit_diff_over_scale": worst, "per_prompt": per_prompt}
    if theirs:
        out["llama_cpp"] = {"agreement": statistics.fmean(theirs), "prompts_all_equal": sum(p == 1.0 for p in theirs),
                            "min_prompt_agreement": min(theirs), "per_prompt": theirs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(ids)} held-out prompts x {args.tokens} greedy tokens ({positions} positions): int8 argmax = float32 "
          f"argmax at {agree:.1%} of positions; {out['prompts_all_equal']} prompts agree at every position; "
          f"lowest prompt {min(per_prompt):.1%}; largest logit difference {worst:.3%} of the logits' scale")
    if theirs:
        print(f"llama.cpp on the same file: its argmax = float32 argmax at {statistics.fmean(theirs):.1%} of "
              f"positions; {out['llama_cpp']['prompts_all_equal']} prompts agree at every position; "
              f"lowest {min(theirs):.1%}")
    return 0


def _llama_cpp(gguf: Path):  # noqa: ANN202 - llama_cpp.Llama, optional
    """llama.cpp on `gguf` with the logits of every position kept, or None without llama-cpp-python."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp figure", file=sys.stderr)
        return None
    return Llama(model_path=str(gguf), n_threads=1, n_ctx=2048, logits_all=True, verbose=False)


if __name__ == "__main__":
    raise SystemExit(main())
