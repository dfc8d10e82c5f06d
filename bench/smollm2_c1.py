"""SmolLM2-135M-Instruct at concurrency 1, side by side with transformers, in interleaved rounds.

    .venv/bin/python bench/smollm2_c1.py --rounds 3 [--max-tokens 96] [--draft-model ngram|DIR]
        [--activations auto|float32|int8] [--out FILE]

The named model `smollm2-135m-instruct` (installed on first use) on two prompt sets, chat-templated:
- `chat`: plain questions (the answer repeats little of the prompt);
- `edit`: "rewrite this code" requests (the answer repeats much of the prompt), where drafting from
  the prompt pays.
Modes, each round running all of them one after another on both sets, one request at a time, greedy,
up to --max-tokens new tokens (the answer ends at the model's end of turn, the same in every mode),
float32 (specserve's services with --activations as given: int8 quantizes activations as llama.cpp does),
one torch thread everywhere:
- `hf_generate`: transformers `generate`;
- `hf_prompt_lookup`: transformers `generate(prompt_lookup_num_tokens=K)` (K = --lookup-tokens);
- `hf_assisted` (only when --draft-model is a model directory, not an EAGLE head): transformers
  `generate(assistant_model=the same draft)`;
- `llama_cpp` (where llama-cpp-python is installed; it is not a specserve dependency: `.venv/bin/pip
  install llama-cpp-python` builds it, about 5 minutes): llama.cpp on the same GGUF file the named
  model keeps as model.gguf, the same token ids, greedy;
- `llama_cpp_lookup` (with `llama_cpp`): llama.cpp's own speculative decoding as llama-cpp-python exposes
  it, prompt lookup (`draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K)`, K = --lookup-tokens);
- `none`, `chain:4`, `adaserve`, `joint` (the default policy): specserve (`specserve up --model
  smollm2-135m-instruct --draft-model D --threads N`, one stack; each policy is a gateway of
  its own on the same target and draft), through the official openai client.
--threads N (default 1) is every mode's thread count: torch's in this process, llama.cpp's, and
each specserve model service's.
Reported per set and mode: median over rounds of tokens/s (new tokens / wall of the mode's
requests) with min-max, the ratios to `hf_generate` and to `llama_cpp` taken within each round
(median, min-max), for specserve the tokens per target pass (1 + accepted drafts per step, from the
responses' `specserve.steps`), and how many answers equal `hf_generate`'s (greedy on the float32
weights dequantized from the same file; llama.cpp also quantizes activations, so its answers need
not). The services run without their prefix cache unless --prefix-caching: every round repeats the
prompts, and neither transformers nor llama.cpp here reuses one request's prefill for the next.

Figures: docs/lab/smollm2_c1.md, "SmolLM2-135M-Instruct at concurrency 1".
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.sweep import spread  # noqa: E402

CHAT = [
    "What are three good habits for writing readable Python code?",
    "Explain in a few sentences what a hash table is.",
    "Give me a short plan for learning to cook at home.",
    "Why is the sky blue? Answer briefly.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
]
_CODE = [
    "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n",
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
    "class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def inc(self):\n        self.n += 1\n"
    "        return self.n\n",
]
EDIT = [f"{task}\n\n```python\n{code}```" for code in _CODE for task in (
    "Add type hints to this code and return the whole code.",
    "Add a docstring to every function in this code and return the whole code.")]
POLICIES = ["none", "chain:4", "adaserve", "joint"]


def add_service_options(ap: argparse.ArgumentParser) -> None:
    """The services' options these benches share: --activations and --prefix-caching."""
    from specserve.shared.runtime.loader import ACTIVATIONS

    ap.add_argument("--activations", default="auto", choices=list(ACTIVATIONS),
                    help="the services' --activations (int8: products on int8-quantized activations, as llama.cpp's)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep the services' prefix cache on (off by default: every round repeats the same prompts, "
                         "and the peers here compute each prompt afresh)")


def service_env(args: argparse.Namespace) -> dict[str, str] | None:
    """The services' environment: this process's (None) with --prefix-caching, else with their prefix cache off."""
    if args.prefix_caching:
        return None
    return {**os.environ, "SPECSERVE_TARGET_PREFIX_CACHING": "0", "SPECSERVE_DRAFT_PREFIX_CACHING": "0"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    ap.add_argument("--draft-model", default="ngram", help="`ngram` or a draft model directory")
    ap.add_argument("--draft-weights", default="auto", help="the draft service's --weights (auto, float32, q8_0, q4_1)")
    add_service_options(ap)
    ap.add_argument("--policies", default=",".join(POLICIES), help="specserve policies, comma-separated")
    ap.add_argument("--sets", default="chat,edit", help="prompt sets, comma-separated: chat, edit")
    ap.add_argument("--threads", type=int, default=1, help="threads of every mode (torch, llama.cpp, the services)")
    ap.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out even where it is installed")
    ap.add_argument("--quiet-s", type=float, default=3.0, help="idle seconds before each mode (with 2 threads, a "
                    "mode run right after transformers' measured up to 1.8x slower without them)")
    ap.add_argument("--out", help="result file (default bench/results/smollm2_c1.json, or smollm2_c1-<draft dir>.json)")
    args = ap.parse_args(argv)
    ngram = args.draft_model == "ngram"
    token_draft = not ngram and (Path(args.draft_model) / "config.json").is_file()  # not an EAGLE head
    args.out = args.out or str(ROOT / "bench" / "results" / (
        "smollm2_c1.json" if ngram else f"smollm2_c1-{Path(args.draft_model).name}.json"))

    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.shared.runtime.model_store import resolve
    from tests.support.procs import Up, gateway

    torch.set_num_threads(args.threads)
    os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))  # up's services and our gateways share it
    model_dir = resolve("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(args.draft_model, dtype=torch.float32).eval() \
        if token_draft else None
    hf_modes = ["hf_generate", "hf_prompt_lookup"] + (["hf_assisted"] if token_draft else [])
    llm = None if args.no_llamacpp else _llama_cpp(Path(model_dir) / "model.gguf", args.threads)
    llm_lookup = None if llm is None else _llama_cpp(Path(model_dir) / "model.gguf", args.threads,
                                                     args.lookup_tokens)
    peer_modes = hf_modes + (["llama_cpp", "llama_cpp_lookup"] if llm is not None else [])
    policies = args.policies.split(",")
    sets = {name: [_ids(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
                   for p in prompts] for name, prompts in (("chat", CHAT), ("edit", EDIT))
            if name in args.sets.split(",")}

    def hf_run(ids: list[int], **kw) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                              pad_token_id=tok.eos_token_id, **kw)
        return out[0, len(ids):].tolist()

    profile = Path(args.out).with_suffix(".profile.json")
    up = Up("--model", "smollm2-135m-instruct", "--draft-model", args.draft_model,
            "--draft-weights", args.draft_weights, "--activations", args.activations, "--policy", "none",
            "--threads", str(args.threads), "--profile", str(profile), timeout_s=900,
            env=service_env(args))
    gateways = {p: gateway(up, p, "--model", model_dir, "--profile", str(profile)) for p in policies if p != "none"}
    urls = {"none": up.url, **{p: g.address for p, g in gateways.items()}}
    prompts_of = {"chat": CHAT, "edit": EDIT}
    rounds = []
    try:
        clients = {p: openai.OpenAI(base_url=f"{u}/v1", api_key="unused", max_retries=0, timeout=600)
                   for p, u in urls.items()}
        for r in range(args.rounds):
            row: dict = {}
            for name, ids_list in sets.items():
                ref = []
                for mode in [*peer_modes, *policies]:
                    time.sleep(args.quiet_s)
                    t0, outs, steps, n = time.perf_counter(), [], [], 0
                    for i, ids in enumerate(ids_list):
                        if mode.startswith("llama_cpp"):
                            new = _llama_generate(llm if mode == "llama_cpp" else llm_lookup, ids, args.max_tokens,
                                                  tok.eos_token_id)
                            outs.append(tok.decode(new, skip_special_tokens=True))
                            n += len(new)
                        elif mode.startswith("hf"):
                            kw = ({"prompt_lookup_num_tokens": args.lookup_tokens} if mode == "hf_prompt_lookup"
                                  else {"assistant_model": assistant} if mode == "hf_assisted" else {})
                            new = hf_run(ids, **kw)
                            outs.append(tok.decode(new, skip_special_tokens=True))
                            n += len(new)
                        else:
                            resp = clients[mode].chat.completions.create(
                                model="smollm2-135m-instruct", temperature=0, max_tokens=args.max_tokens,
                                messages=[{"role": "user", "content": prompts_of[name][i]}],
                                service_tier="critical")
                            outs.append(resp.choices[0].message.content)
                            steps += resp.model_extra["specserve"]["steps"]
                            n += resp.usage.completion_tokens
                    wall = time.perf_counter() - t0
                    if mode == "hf_generate":
                        ref = outs
                    same = sum(a == b for a, b in zip(outs, ref))
                    row[f"{name}/{mode}"] = {"tokens_per_s": n / wall, "identical": same,
                                             "tokens_per_pass": (sum(1 + a for _, _, a in steps) / len(steps))
                                             if steps else None}
                    print(f"round {r + 1} {name:5s} {mode:17s} {n / wall:7.2f} tok/s"
                          + (f"  {row[f'{name}/{mode}']['tokens_per_pass']:.2f} tok/pass" if steps else "")
                          + ("" if same == len(ref) else f"  {len(ref) - same} answer(s) differ"), flush=True)
            rounds.append(row)
    finally:
        for g in gateways.values():
            g.stop()
        up.interrupt()
    summary = {}
    for key in rounds[0]:
        tps = [rd[key]["tokens_per_s"] for rd in rounds]
        ratio = [rd[key]["tokens_per_s"] / rd[key.split("/")[0] + "/hf_generate"]["tokens_per_s"] for rd in rounds]
        llama = [rd[key]["tokens_per_s"] / rd[key.split("/")[0] + "/llama_cpp"]["tokens_per_s"] for rd in rounds
                 if key.split("/")[0] + "/llama_cpp" in rd]
        passes = [rd[key]["tokens_per_pass"] for rd in rounds if rd[key]["tokens_per_pass"] is not None]
        summary[key] = {"tokens_per_s": spread(tps), "vs_hf_generate": spread(ratio),
                        "vs_llama_cpp": spread(llama) if llama else None,
                        "tokens_per_pass": spread(passes) if passes else None,
                        "identical_to_hf_generate":
                            f"{min(rd[key]['identical'] for rd in rounds)}/{len(sets[key.split('/')[0]])}"}
    out = {"meta": {"rounds": args.rounds, "max_tokens": args.max_tokens, "threads": args.threads, "dtype": "float32",
                    "draft_model": args.draft_model, "draft_weights": args.draft_weights,
                    "activations": args.activations, "prefix_caching": args.prefix_caching, "policies": policies,
                    "sets": list(sets),
                    "lookup_tokens": args.lookup_tokens, "cpu_count": os.cpu_count()},
           "rounds": rounds, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("\n| set / mode | tokens/s (median, min-max) | vs hf_generate | vs llama_cpp | tokens per pass "
          "| answers = hf_generate's |")
    print("|---|---|---|---|---|---|")
    for key, s in summary.items():
        tp, ll = s["tokens_per_pass"], s["vs_llama_cpp"]
        print(f"| {key} | {s['tokens_per_s']['median']:.2f} ({s['tokens_per_s']['min']:.2f}-"
              f"{s['tokens_per_s']['max']:.2f}) | {s['vs_hf_generate']['median']:.2f}x "
              f"({s['vs_hf_generate']['min']:.2f}-{s['vs_hf_generate']['max']:.2f}) | "
              + ("" if ll is None else f"{ll['median']:.2f}x ({ll['min']:.2f}-{ll['max']:.2f})")
              + f" | {'' if tp is None else format(tp['median'], '.2f')} | {s['identical_to_hf_generate']} |")
    return 0


def _llama_cpp(gguf: Path, threads: int, lookup_tokens: int = 0):  # noqa: ANN202 - llama_cpp.Llama, optional
    """llama.cpp on `gguf` (with prompt-lookup speculation of `lookup_tokens` when > 0), or None (with a line
    saying so) where llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("llama-cpp-python is not installed: no llama_cpp mode (`.venv/bin/pip install llama-cpp-python`)",
              flush=True)
        return None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
    return Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False,
                 draft_model=draft)


def _llama_generate(llm, ids: list[int], max_tokens: int, eos: int) -> list[int]:  # noqa: ANN001
    """Greedy (temperature 0, top-k 1) new tokens of llama.cpp after `ids`, up to max_tokens or eos."""
    new: list[int] = []
    for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        new.append(t)  # the end of turn counts, as in hf_generate's tokens
        if t == eos or len(new) == max_tokens:
            break
    return new


def _ids(out) -> list[int]:
    return list(out if isinstance(out, list) else out["input_ids"])


if __name__ == "__main__":
    raise SystemExit(main())
