"""SmolLM2-135M-Instruct, 16 requests at once, side by side with transformers' batched generate.

    .venv/bin/python bench/smollm2_batch.py --rounds 3 [--batch 16] [--max-tokens 96]
        [--activations auto|float32|int8] [--out FILE]

The 12 prompts of bench/smollm2_c1.py (6 chat, 6 edit; chat-templated), cycled to --batch requests,
greedy, up to --max-tokens new tokens each (an answer ends at the model's end of turn), float32 (specserve's
services with --activations as given: int8 answers are not transformers', and are counted), --threads
(default 1) in every mode. Each round runs, one after another:
- `hf_batched`: transformers `generate` over the whole batch at once (left-padded, one call);
- `llama_cpp` (where llama-cpp-python is installed, as in bench/smollm2_c1.py): llama.cpp on the same GGUF
  file, the requests one after another (llama-cpp-python has no batched generation of several sequences);
- `none` and `joint` (the default policy): specserve (`specserve up --model smollm2-135m-instruct
  --threads N`, one stack, its default n-gram draft; `joint` is a second gateway on the same target
  and draft), the --batch requests sent at once through the official openai client (chat tier, best
  effort allowed: SLO admission serves every request, and the run measures speed, not refusals).
Reported per mode: the median over rounds of tokens/s (new tokens / wall from the first send to the
last answer) with min-max, and the ratio to `hf_batched` taken within each round. Every answer is
checked equal to the same prompt's answer under transformers `generate` at batch 1 (computed once,
before the rounds); a batched `generate` may differ from it (padding changes float32 sums), and is
reported, not required, to be equal. The services run without their prefix cache unless --prefix-caching
(as in bench/smollm2_c1.py). Per specserve mode and round also (`iterations` in the results, from the gateway's
counters as bench/step_overhead.py reads them): its iterations, their mean time and its split (target, draft,
transport, scheduling), the draft nodes verified beyond the roots and those accepted, and the last request's
time to first token.

Figures: docs/lab/smollm2_batch.md, "SmolLM2-135M-Instruct, 16 at once".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.smollm2_c1 import CHAT, EDIT, _ids, _llama_cpp, _llama_generate, add_service_options, service_env  # noqa: E402
from bench.step_overhead import iteration_split  # noqa: E402
from bench.sweep import spread  # noqa: E402

POLICIES = ["none", "joint"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--policies", default=",".join(POLICIES), help="specserve policies, comma-separated")
    ap.add_argument("--threads", type=int, default=1, help="threads of every mode (torch, llama.cpp, the services)")
    add_service_options(ap)
    ap.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out even where it is installed")
    ap.add_argument("--quiet-s", type=float, default=3.0, help="idle seconds before each mode (with 2 threads, a "
                    "mode run right after transformers' measured up to 1.8x slower without them)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "smollm2_batch.json"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.batch < 1:
        ap.error("--rounds and --batch must be >= 1")

    import httpx
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.cli.loadgen.scrape import parse_counters, server_delta
    from specserve.shared.runtime.model_store import resolve
    from tests.support.procs import Up, gateway

    def counters(url: str) -> dict[str, float]:
        return parse_counters(httpx.get(f"{url}/metrics", timeout=60).text)

    torch.set_num_threads(args.threads)
    os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))  # up's services and our gateway share it
    model_dir = resolve("smollm2-135m-instruct")
    llm = None if args.no_llamacpp else _llama_cpp(Path(model_dir) / "model.gguf", args.threads)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [(CHAT + EDIT)[i % 12] for i in range(args.batch)]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    policies = args.policies.split(",")

    def generate(prompts: list[str]) -> tuple[list[str], int]:
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = hf.generate(**enc, max_new_tokens=args.max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        new = out[:, enc["input_ids"].shape[1]:]
        answers, n = [], 0
        for row in new.tolist():  # a finished row is padded with eos after its end of turn
            end = row.index(tok.eos_token_id) if tok.eos_token_id in row else len(row)
            answers.append(tok.decode(row[:end], skip_special_tokens=True))
            n += end  # the end of turn not counted, as in the API's usage
        return answers, n

    print("reference: transformers generate at batch 1 ...", flush=True)
    ref = {t: generate([c])[0][0] for t, c in dict(zip(texts, chats)).items()}

    profile = Path(args.out).with_suffix(".profile.json")
    up = Up("--model", "smollm2-135m-instruct", "--policy", policies[0], "--threads", str(args.threads),
            "--activations", args.activations, "--profile", str(profile), timeout_s=900,
            env=service_env(args))
    gateways = {p: gateway(up, p, "--model", model_dir, "--profile", str(profile)) for p in policies[1:]}
    urls = {policies[0]: up.url, **{p: g.address for p, g in gateways.items()}}

    async def serve(url: str) -> tuple[list[str], int, float]:
        """The 16 requests at once: answers, tokens, and the wall time from the first request sent to the last
        answer (the gateway's counters are read before and after, outside it)."""
        before = await asyncio.to_thread(counters, url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1800)
        async with client:
            t0 = time.perf_counter()
            resps = await asyncio.gather(*(client.chat.completions.create(
                model="smollm2-135m-instruct", temperature=0, max_tokens=args.max_tokens, service_tier="chat",
                extra_body={"slo": {"best_effort": True}},  # a throughput run: served, never refused
                messages=[{"role": "user", "content": t}]) for t in texts))
            wall = time.perf_counter() - t0
        after = await asyncio.to_thread(counters, url)
        reports = [r.model_extra["specserve"] for r in resps]
        steps = [s for rep in reports for s in rep["steps"]]
        passes.append(sum(1 + accepted for _, _, accepted in steps) / len(steps))
        splits.append({**iteration_split(server_delta(before, after)["iteration"]),
                       "drafted_nodes": sum(nodes - 1 for _, nodes, _ in steps),
                       "accepted": sum(accepted for _, _, accepted in steps),
                       "last_ttft_ms": max(rep["ttft_ms"] for rep in reports)})
        return [r.choices[0].message.content for r in resps], sum(r.usage.completion_tokens for r in resps), wall

    def llama_cpp() -> tuple[list[str], int]:
        answers, n = [], 0
        for chat in chats:
            new = _llama_generate(llm, _ids(tok(chat, add_special_tokens=False)), args.max_tokens, tok.eos_token_id)
            answers.append(tok.decode(new, skip_special_tokens=True))
            n += len(new) - (new[-1] == tok.eos_token_id)  # the end of turn not counted, as in the API's usage
        return answers, n

    modes = ["hf_batched", *(["llama_cpp"] if llm is not None else []), *policies]
    rounds, passes, splits = [], [], []  # of each specserve mode run: tokens per target pass, the iteration split
    try:
        for r in range(args.rounds):
            row = {}
            for mode in modes:
                time.sleep(args.quiet_s)
                if mode in ("hf_batched", "llama_cpp"):
                    t0 = time.perf_counter()
                    answers, n = generate(chats) if mode == "hf_batched" else llama_cpp()
                    wall = time.perf_counter() - t0
                else:
                    answers, n, wall = asyncio.run(serve(urls[mode]))
                same = sum(a == ref[t] for a, t in zip(answers, texts))
                ours = mode not in ("hf_batched", "llama_cpp")
                per_pass, split = (passes[-1], splits[-1]) if ours else (None, None)
                row[mode] = {"tokens_per_s": n / wall, "tokens": n, "wall_s": wall, "equal_to_generate": same,
                             "tokens_per_pass": per_pass, "iterations": split}
                print(f"round {r + 1} {mode:10s} {n / wall:7.2f} tok/s  {n} tokens  "
                      f"{same}/{len(texts)} equal to generate at batch 1"
                      + ("" if split is None else
                         f"  {per_pass:.2f} tokens per pass; {split['iterations']} iterations of "
                         f"{split['iteration_ms']:.2f} ms (target {split['target_ms']:.2f}); "
                         f"{split['drafted_nodes']} drafted nodes, {split['accepted']} accepted; "
                         f"last first token at {split['last_ttft_ms']:.0f} ms"), flush=True)
            rounds.append(row)
    finally:
        for g in gateways.values():
            g.stop()
        up.interrupt()
    summary = {}
    for mode in rounds[0]:
        tps = [rd[mode]["tokens_per_s"] for rd in rounds]
        ratio = [rd[mode]["tokens_per_s"] / rd["hf_batched"]["tokens_per_s"] for rd in rounds]
        llama = [rd[mode]["tokens_per_s"] / rd["llama_cpp"]["tokens_per_s"] for rd in rounds if "llama_cpp" in rd]
        summary[mode] = {"tokens_per_s": spread(tps), "vs_hf_batched": spread(ratio),
                         "vs_llama_cpp": spread(llama) if llama else None,
                         "equal_every_round": min(rd[mode]["equal_to_generate"] for rd in rounds)}
    out = {"meta": {"rounds": args.rounds, "batch": args.batch, "max_tokens": args.max_tokens, "threads": args.threads,
                    "activations": args.activations, "prefix_caching": args.prefix_caching, "dtype": "float32",
                    "draft_model": "ngram", "policies": policies, "cpu_count": os.cpu_count()},
           "rounds": rounds, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n| mode | tokens/s (median, min-max) | vs hf_batched | vs llama_cpp | equal to generate at batch 1 "
          f"(of {args.batch}) |")
    print("|---|---|---|---|---|")
    for mode, s in summary.items():
        t, x, ll = s["tokens_per_s"], s["vs_hf_batched"], s["vs_llama_cpp"]
        print(f"| {mode} | {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f}) | {x['median']:.2f}x "
              f"({x['min']:.2f}-{x['max']:.2f}) | "
              + ("" if ll is None else f"{ll['median']:.2f}x ({ll['min']:.2f}-{ll['max']:.2f})")
              + f" | {s['equal_every_round']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
