"""The peer a CPU user would pick today: Hugging Face transformers `generate` and assisted generation.

    .venv/bin/python bench/hf_peer.py --runs 3 --out bench/results/hf_peer.json
        [--prompts N] [--max-tokens M] [--threads T] [--batch-sizes 1,4,8,16] [--workload FILE]

Runs the bundled demo pair (`models/target`, assisted by `models/draft`) through stock
`transformers` on the CPU, float32, on the first N prompts of the workload our server benchmark
uses (`bench/workloads/short.jsonl`), and reports throughput and per-token latency in three modes,
all greedy (`do_sample=False`):

1. `generate`: `model.generate(...)`, batch size 1, the prompts one after another.
2. `assisted`: `model.generate(..., assistant_model=draft)` with transformers' default assisted
   settings (up to `num_assistant_tokens` = 20 drafted tokens per step, drafting stops early when the
   draft's confidence falls under `assistant_confidence_threshold` = 0.4; the threshold is adapted
   only when scikit-learn is installed, which `meta` records). Batch size 1 only (transformers
   supports nothing else), sequential. Its outputs are checked token for token against mode 1
   (`identical_to_generate`, `prompts_differing`), and the draft's acceptance is recorded by
   wrapping transformers' `AssistedCandidateGenerator` (drafted tokens, accepted tokens, target
   forwards).
3. `batched`: plain `generate` over left-padded batches of each size in `--batch-sizes`
   (ceil(N/bs) batches; when N < bs the prompts repeat cyclically to fill the batch). The best
   batch size is "its best" throughput.

Every request generates exactly M new tokens: EOS is ignored by passing `eos_token_id=None` to
`generate` (which overrides the models' `generation_config.json`; `min_new_tokens` is not used,
as it would mask EOS and change the argmax tokens). The script checks that every output has M tokens.

Metrics:
- `tokens_per_s`: new tokens / wall time of the mode's calls (tokenization excluded, batching and
  padding included).
- `ttft_ms`: time to the first new token, taken from a streamer (the first `put` after the prompt).
- `tpot_ms`: per request (wall - TTFT) / (M - 1), averaged over requests (modes 1 and 2). For
  assisted generation the first `put` can already carry several tokens; the formula is the usual
  TPOT all the same, so it is comparable with the server benchmark's.
- `ms_per_step` (batched): wall time of one batch / M, averaged over batches: the latency each
  request in the batch sees per token, prefill included.

Method: models load once; each mode is warmed up once (one request, or one batch per batch size)
before timing; then `--runs` runs, each running every mode in turn (generate, assisted, batched at
each size), so machine noise hits all modes alike. Reported: median and min-max over runs. The
intra-op thread count is `--threads` (default 1: these models are tiny, and more threads only add
synchronisation; the reference machine has 2 noisy cores). With the defaults (8 prompts, 64 tokens,
3 runs) the whole script takes about 70 s on that machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

ROOT = Path(__file__).resolve().parent.parent
TARGET_DIR = ROOT / "models" / "target"
DRAFT_DIR = ROOT / "models" / "draft"
WORKLOAD = ROOT / "bench" / "workloads" / "short.jsonl"


# --------------------------------------------------------------------------------------------- helpers


def _load_model(path: Path) -> transformers.PreTrainedModel:
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except TypeError:  # transformers < 4.56 knows only `torch_dtype`
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.to("cpu").eval()


def load_prompts(path: Path, n: int) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) == n:
                break
    if len(rows) < n:
        raise SystemExit(f"{path} has only {len(rows)} prompts, --prompts {n} asked for")
    return rows


def _summary(values: Sequence[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": list(values),
    }


class _FirstTokenTimer(BaseStreamer):
    """Records when the first new tokens arrive: `generate` first puts the prompt, then new tokens."""

    def __init__(self) -> None:
        self.calls = 0
        self.t_first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


class _AcceptanceProbe:
    """Counts drafted and accepted tokens by wrapping transformers' AssistedCandidateGenerator."""

    def __init__(self) -> None:
        self.drafted = 0
        self.accepted = 0
        self.target_forwards = 0
        self.available = False

    @contextlib.contextmanager
    def active(self) -> Iterator[_AcceptanceProbe]:
        try:
            from transformers.generation.candidate_generator import AssistedCandidateGenerator
        except ImportError:
            yield self
            return
        cls = AssistedCandidateGenerator
        if "get_candidates" not in cls.__dict__ or "update_candidate_strategy" not in cls.__dict__:
            yield self
            return
        self.available = True
        orig_get, orig_update = cls.get_candidates, cls.update_candidate_strategy
        probe = self

        def get_candidates(gen, input_ids, *args, **kwargs):
            candidate_ids, candidate_logits = orig_get(gen, input_ids, *args, **kwargs)
            probe.drafted += int(candidate_ids.shape[1] - input_ids.shape[1])
            probe.target_forwards += 1
            return candidate_ids, candidate_logits

        def update_candidate_strategy(gen, input_ids, scores, num_matches):
            probe.accepted += int(num_matches)
            return orig_update(gen, input_ids, scores, num_matches)

        cls.get_candidates = get_candidates
        cls.update_candidate_strategy = update_candidate_strategy
        try:
            yield self
        finally:
            cls.get_candidates = orig_get
            cls.update_candidate_strategy = orig_update


# --------------------------------------------------------------------------------------------- modes


def _generate_kwargs(max_tokens: int) -> dict[str, Any]:
    # eos_token_id=None overrides generation_config.json's [0, 4], so no request stops early.
    return {"do_sample": False, "max_new_tokens": max_tokens, "eos_token_id": None}


def run_sequential(
    model: transformers.PreTrainedModel,
    prompt_ids: list[torch.Tensor],
    max_tokens: int,
    assistant: transformers.PreTrainedModel | None = None,
) -> dict[str, Any]:
    """Batch size 1, one request after another. Returns timings and the new tokens of each request."""
    walls, ttfts, outputs = [], [], []
    extra = {"assistant_model": assistant} if assistant is not None else {}
    gc.collect()
    for ids in prompt_ids:
        streamer = _FirstTokenTimer()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                             **_generate_kwargs(max_tokens), **extra)
        t1 = time.perf_counter()
        walls.append(t1 - t0)
        ttfts.append((streamer.t_first if streamer.t_first is not None else t1) - t0)
        outputs.append(out[0, ids.shape[1]:].tolist())
    n_tokens = sum(len(o) for o in outputs)
    denom = max(max_tokens - 1, 1)
    return {
        "tokens": n_tokens,
        "wall_s": sum(walls),
        "tokens_per_s": n_tokens / sum(walls),
        "ttft_ms": 1e3 * statistics.fmean(ttfts),
        "tpot_ms": 1e3 * statistics.fmean((w - f) / denom for w, f in zip(walls, ttfts)),
        "ms_per_token_wall": 1e3 * statistics.fmean(w / max_tokens for w in walls),
        "outputs": outputs,
    }


def make_batches(n_prompts: int, batch_size: int) -> list[list[int]]:
    """ceil(N/bs) batches of prompt indices; when N < bs, the prompts repeat cyclically to fill one batch."""
    if n_prompts < batch_size:
        return [[i % n_prompts for i in range(batch_size)]]
    return [list(range(s, min(s + batch_size, n_prompts))) for s in range(0, n_prompts, batch_size)]


def run_batched(
    model: transformers.PreTrainedModel, tokenizer: Any, prompts: list[str], max_tokens: int, batch_size: int
) -> dict[str, Any]:
    batches = []
    for idx in make_batches(len(prompts), batch_size):
        enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True)
        batches.append((idx, enc["input_ids"], enc["attention_mask"]))
    walls, outputs = [], {}
    n_tokens = 0
    gc.collect()
    for idx, ids, mask in batches:
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **_generate_kwargs(max_tokens))
        walls.append(time.perf_counter() - t0)
        new = out[:, ids.shape[1]:]
        n_tokens += new.numel()
        for row, i in enumerate(idx):
            outputs.setdefault(i, new[row].tolist())
    return {
        "tokens": n_tokens,
        "wall_s": sum(walls),
        "tokens_per_s": n_tokens / sum(walls),
        "ms_per_step": 1e3 * statistics.fmean(w / max_tokens for w in walls),
        "batches": len(batches),
        "outputs": [outputs[i] for i in range(len(prompts))],
    }


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="the first N rows of the workload (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request, EOS ignored (default 64)")
    p.add_argument("--runs", type=int, default=3, help="timed runs; medians and min-max reported (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--batch-sizes", default="1,4,8,16", help="batch sizes of the batched mode (default 1,4,8,16)")
    p.add_argument("--workload", type=Path, default=WORKLOAD, help=f"JSONL prompts (default {WORKLOAD})")
    p.add_argument("--target", type=Path, default=TARGET_DIR, help=argparse.SUPPRESS)
    p.add_argument("--draft", type=Path, default=DRAFT_DIR, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout table only)")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    if args.prompts < 1 or args.max_tokens < 1 or args.runs < 1 or args.threads < 1:
        p.error("--prompts, --max-tokens, --runs and --threads must be >= 1")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes must be a comma-separated list of positive integers")
    return args


def format_table(results: dict[str, Any]) -> str:
    def tps(s: dict[str, Any]) -> str:
        return f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"

    lines = [
        "| mode | batch | tokens/s median (min–max) | ms/token median |",
        "|---|---|---|---|",
    ]
    for mode in ("generate", "assisted"):
        r = results[mode]
        lines.append(f"| {mode} | 1 | {tps(r['tokens_per_s'])} | {r['tpot_ms']['median']:.2f} |")
    best = results["batched"]["best"]["batch_size"]
    for bs, r in results["batched"]["by_batch_size"].items():
        mark = " (best)" if int(bs) == best else ""
        lines.append(f"| batched{mark} | {bs} | {tps(r['tokens_per_s'])} | {r['ms_per_step']['median']:.2f} |")
    lines.append("")
    lines.append("ms/token: TPOT = (wall - TTFT) / (M - 1) per request for generate/assisted; "
                 "batch wall / M (per-request step latency, prefill included) for batched.")
    a = results["assisted"]
    acc = a.get("acceptance")
    acc_txt = (f"; draft acceptance {acc['rate']:.1%} ({acc['accepted']}/{acc['drafted']}), "
               f"{acc['tokens_per_target_forward']:.2f} tokens per target forward") if acc else ""
    lines.append(f"assisted identical to generate: {a['identical_to_generate']} "
                 f"({a['prompts_differing']} prompts differ){acc_txt}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    rows = load_prompts(args.workload, args.prompts)
    prompts = [r["prompt"] for r in rows]
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        # No pad token: use EOS, or id 0 (padded positions are masked out, so which id is irrelevant).
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    target = _load_model(args.target)
    draft = _load_model(args.draft)
    prompt_ids = [tokenizer(p, return_tensors="pt")["input_ids"] for p in prompts]
    M = args.max_tokens

    steps_per_run = 2 + len(args.batch_sizes)
    bar = tqdm(total=steps_per_run * (args.runs + 1), desc="hf_peer", file=sys.stderr, unit="step", leave=False)
    raw: dict[str, list[dict[str, Any]]] = {"generate": [], "assisted": []}
    raw_batched: dict[int, list[dict[str, Any]]] = {bs: [] for bs in args.batch_sizes}
    probe = _AcceptanceProbe()

    with torch.inference_mode():
        # Warm-up: one request per sequential mode, one batch per batch size.
        bar.set_description("warm-up generate")
        run_sequential(target, prompt_ids[:1], M)
        bar.update()
        bar.set_description("warm-up assisted")
        run_sequential(target, prompt_ids[:1], M, assistant=draft)
        bar.update()
        for bs in args.batch_sizes:
            bar.set_description(f"warm-up batched bs={bs}")
            first = make_batches(len(prompts), bs)[0]
            run_batched(target, tokenizer, [prompts[i] for i in first], M, bs)
            bar.update()

        for run in range(args.runs):
            bar.set_description(f"run {run + 1}/{args.runs} generate")
            raw["generate"].append(run_sequential(target, prompt_ids, M))
            bar.update()
            bar.set_description(f"run {run + 1}/{args.runs} assisted")
            with probe.active():
                raw["assisted"].append(run_sequential(target, prompt_ids, M, assistant=draft))
            bar.update()
            for bs in args.batch_sizes:
                bar.set_description(f"run {run + 1}/{args.runs} batched bs={bs}")
                raw_batched[bs].append(run_batched(target, tokenizer, prompts, M, bs))
                bar.update()
    bar.close()

    reference = raw["generate"][0]["outputs"]
    all_outputs = [o for r in raw["generate"] + raw["assisted"] for o in r["outputs"]]
    all_outputs += [o for rs in raw_batched.values() for r in rs for o in r["outputs"]]
    lengths_fixed = all(len(o) == M for o in all_outputs)
    generate_stable = all(r["outputs"] == reference for r in raw["generate"])

    results: dict[str, Any] = {}
    for mode in ("generate", "assisted"):
        rs = raw[mode]
        results[mode] = {
            "batch_size": 1,
            "tokens_per_s": _summary([r["tokens_per_s"] for r in rs]),
            "tpot_ms": _summary([r["tpot_ms"] for r in rs]),
            "ttft_ms": _summary([r["ttft_ms"] for r in rs]),
            "ms_per_token_wall": _summary([r["ms_per_token_wall"] for r in rs]),
            "wall_s": _summary([r["wall_s"] for r in rs]),
            "tokens_per_run": rs[0]["tokens"],
        }
    differing = max(sum(a != g for a, g in zip(r["outputs"], reference)) for r in raw["assisted"])
    results["assisted"]["identical_to_generate"] = differing == 0
    results["assisted"]["prompts_differing"] = differing
    if probe.available and probe.target_forwards:
        results["assisted"]["acceptance"] = {
            "drafted": probe.drafted,
            "accepted": probe.accepted,
            "rate": probe.accepted / probe.drafted if probe.drafted else 0.0,
            "target_forwards": probe.target_forwards,
            "tokens_per_target_forward": (args.runs * args.prompts * M) / probe.target_forwards,
            "drafted_per_target_forward": probe.drafted / probe.target_forwards,
            "note": "summed over the timed runs (deterministic, so identical per run)",
        }
    else:
        results["assisted"]["acceptance"] = None

    by_bs: dict[str, Any] = {}
    for bs, rs in raw_batched.items():
        by_bs[str(bs)] = {
            "batch_size": bs,
            "batches": rs[0]["batches"],
            "tokens_per_run": rs[0]["tokens"],
            "tokens_per_s": _summary([r["tokens_per_s"] for r in rs]),
            "ms_per_step": _summary([r["ms_per_step"] for r in rs]),
            "wall_s": _summary([r["wall_s"] for r in rs]),
            "prompts_matching_generate": sum(o == g for o, g in zip(rs[0]["outputs"], reference)),
        }
    best_bs = max(args.batch_sizes, key=lambda b: by_bs[str(b)]["tokens_per_s"]["median"])
    results["batched"] = {
        "by_batch_size": by_bs,
        "best": {"batch_size": best_bs, "tokens_per_s": by_bs[str(best_bs)]["tokens_per_s"]["median"]},
        "note": "left padding; prompts_matching_generate compares with batch-1 greedy (padding can change "
                "float32 rounding, so a few may differ; informational)",
    }

    total_s = time.perf_counter() - t_start
    # transformers 5 leaves unset fields None in GenerationConfig() and fills them from global defaults in generate().
    gen_cfg = transformers.GenerationConfig()
    defaults_fn = getattr(gen_cfg, "_get_default_generation_params", None)
    gen_defaults = defaults_fn() if callable(defaults_fn) else {}

    def assisted_default(key: str) -> Any:
        for cfg in (target.generation_config, draft.generation_config, gen_cfg):
            if getattr(cfg, key, None) is not None:
                return getattr(cfg, key)
        return gen_defaults.get(key)

    report = {
        "meta": {
            "benchmark": "hf_peer",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "dtype": "float32",
            "device": "cpu",
            "target": str(args.target.relative_to(ROOT) if args.target.is_relative_to(ROOT) else args.target),
            "draft": str(args.draft.relative_to(ROOT) if args.draft.is_relative_to(ROOT) else args.draft),
            "workload": str(args.workload.relative_to(ROOT) if args.workload.is_relative_to(ROOT) else args.workload),
            "prompts": args.prompts,
            "prompt_ids": [r["id"] for r in rows],
            "prompt_tokens": [int(ids.shape[1]) for ids in prompt_ids],
            "max_tokens": M,
            "runs": args.runs,
            "batch_sizes": args.batch_sizes,
            "greedy": True,
            "eos_ignored": True,
            "all_lengths_fixed": lengths_fixed,
            "generate_deterministic_across_runs": generate_stable,
            "assisted_defaults": {
                "num_assistant_tokens": assisted_default("num_assistant_tokens"),
                "num_assistant_tokens_schedule": assisted_default("num_assistant_tokens_schedule"),
                "assistant_confidence_threshold": assisted_default("assistant_confidence_threshold"),
                "threshold_adapted (sklearn installed)": importlib.util.find_spec("sklearn") is not None,
            },
            "total_runtime_s": total_s,
        },
        "results": results,
    }

    print(format_table(results))
    print(f"\n{args.prompts} prompts x {M} tokens, {args.runs} runs, {args.threads} thread(s), "
          f"transformers {transformers.__version__}, torch {torch.__version__}; total {total_s:.1f} s")
    if not lengths_fixed:
        print("WARNING: some outputs do not have exactly --max-tokens tokens (EOS not ignored?)", file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
