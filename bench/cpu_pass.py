"""One model pass of SmolLM2-135M-Instruct on the CPU: the compiled operators against the torch pass and
torch's own int4 kernel, the weight-read floor, where the time goes, and the draft's step.

    .venv/bin/python bench/cpu_pass.py [--threads 1] [--rounds 3] [--context 100] [--out FILE]
    .venv/bin/python bench/cpu_pass.py --variants avx512,avx2,generic [--rounds 3] [--out FILE]

Measured in one process, in interleaved rounds (median over rounds of each round's median of 15
passes, with the min-max over rounds):
- `floor`: the bytes of weights one pass reads (the stored blocks of every projection and the head)
  divided by this core's measured read bandwidth (a float32 sum over 1 GiB, best of 5);
- `compiled`: the compiled CPU pass (LeanModel) on model.gguf's Q4_1 / Q8_0 blocks with float32
  activations, a tree of T nodes (a chain) over a committed context of --context tokens, T = 1..16;
- `int8`: the same pass (the same loaded model) on int8 activations (per token per 32-wide block, the
  products with the blocks in int32: torch.ops.specserve_cpu.int8_variant() says which code), and the
  cost of each extra token of a tree, (int8/T - int8/1) / (T - 1), as a fraction of int8/1;
- `torch`: the torch pass on the float32 weights, the same trees;
- `int4_bf16`: the matrix products alone (every projection and the head) through torch's
  `_weight_int4pack_mm_for_cpu` (group size 32, the Q4_1 blocks mapped exactly: scale d, zero m + 8d)
  with bfloat16 activations, the fastest kernel torch 2.13 has for these weights;
- `phases` (float32) and `phases_int8`: the compiled pass's own timers at T = 1 and 16
  (torch.ops.specserve_cpu.profile): the matrix products, attention, norms, ..., and the time outside
  the operators (Python, inputs);
- `draft`: one step (T = 1) of models/smollm2-draft in the compiled pass, float32 and quantized at
  load to q8_0 / q4_1 (float32 activations; `_int8`: int8 ones), against the target's.
Each timing run takes /tmp/specserve-bench.lock (flock) where the machine is shared.
With --variants, only the compiled pass at T = 1 and 4 (a 4-node chain), for each listed code variant of
the operators in turn within every round (switched in-process by kernels.set_variant; a variant the
CPU cannot run is refused), into bench/results/cpu_pass_variants.json by default.
With --parallel (e.g. pool,openmp), only the compiled pass at T = 1 and 4, float32 and int8 activations,
under each of --thread-counts (default 1,2) and each listed way of splitting the operators' loops
(kernels.set_parallel: "pool", the library's worker pool, or "openmp", at::parallel_for), both on a quiet
machine and beside a process spinning on a core (a `while True: pass` started for that half of each round
and killed after), into bench/results/cpu_pass_threads.json by default.
Figures: docs/lab/cpu_pass.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.sweep import spread  # noqa: E402

TOKENS = (1, 2, 4, 8, 16)
MATMULS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "head")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=100, help="committed tokens before the measured tree")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/cpu_pass.json, or "
                    "cpu_pass_variants.json with --variants)")
    ap.add_argument("--variants", default=None, help="comma-separated CPU kernel variants to compare "
                    "(avx512, avx2, generic): the compiled pass alone at T = 1 and 4")
    ap.add_argument("--parallel", default=None, help="comma-separated ways to split the operators' loops to "
                    "compare (pool, openmp): the compiled pass alone at T = 1 and 4, quiet and beside a busy core")
    ap.add_argument("--thread-counts", default="1,2", help="with --parallel: the thread counts (default 1,2)")
    args = ap.parse_args(argv)
    if args.variants:
        return _variants_main(args)
    if args.parallel:
        return _parallel_main(args)
    args.out = args.out or str(ROOT / "bench" / "results" / "cpu_pass.json")

    import torch

    from specserve.shared.runtime import kernels
    from specserve.shared.runtime.model_store import resolve
    from specserve.shared.runtime.runner import ModelRunner

    torch.set_num_threads(args.threads)
    assert kernels.load(), kernels.error()
    model_dir = resolve("smollm2-135m-instruct")
    compiled = ModelRunner.from_dir(model_dir, num_blocks=256, kernels="cpu", activations="float32")
    torch_pass = ModelRunner.from_dir(model_dir, num_blocks=256, kernels="torch")
    drafts = {w: ModelRunner.from_dir(ROOT / "models" / "smollm2-draft", num_blocks=256, weights=w,
                                      activations="float32") for w in ("float32", "q8_0", "q4_1")}
    context = [(i * 7) % 4000 + 10 for i in range(args.context)]
    int4 = _int4_products(compiled.model, torch)
    nbytes = compiled.model.weight_bytes

    rounds = []
    for r in range(args.rounds):
        row: dict = {"floor_ms": nbytes / _bandwidth(torch) * 1e3}
        for t in TOKENS:
            compiled.model.activations = "float32"
            row[f"compiled/{t}"] = tree_ms(compiled, context, t)
            compiled.model.activations = "int8"
            row[f"int8/{t}"] = tree_ms(compiled, context, t)
            row[f"torch/{t}"] = tree_ms(torch_pass, context, t)
            row[f"int4_bf16/{t}"] = _time_ms(lambda t=t: int4(t))
        for t in TOKENS[1:]:
            row[f"int8_extra/{t}"] = (row[f"int8/{t}"] - row["int8/1"]) / (t - 1) / row["int8/1"]
        for mode, key in (("float32", "phases"), ("int8", "phases_int8")):
            compiled.model.activations = mode
            for t in (1, 16):
                # 10 profiled passes after 3 warm-up ones
                total = tree_ms(compiled, context, t, repeats=13, profile=True)
                phases = {line.split()[0]: float(line.split()[1]) * 1e3 / 10
                          for line in torch.ops.specserve_cpu.profile(False).strip().splitlines()}
                phases["outside the operators"] = total - sum(phases.values())
                row[f"{key}/{t}"] = phases
        for weights, runner in drafts.items():
            row[f"draft_{weights}/1"] = tree_ms(runner, context, 1)
            if weights != "float32":
                runner.model.activations = "int8"
                row[f"draft_{weights}_int8/1"] = tree_ms(runner, context, 1)
                runner.model.activations = "float32"
        rounds.append(row)
        print(f"round {r + 1}: floor {row['floor_ms']:.2f} ms; compiled T=1 {row['compiled/1']:.2f} ms, "
              f"int8 T=1 {row['int8/1']:.2f} ms, int8 T=8 {row['int8/8']:.2f} ms, "
              f"torch T=1 {row['torch/1']:.2f} ms, int4_bf16 T=1 {row['int4_bf16/1']:.2f} ms; "
              f"draft q8_0 {row['draft_q8_0/1']:.2f} ms", flush=True)

    summary = {key: spread([rd[key] for rd in rounds]) for key in rounds[0] if not key.startswith("phases")}
    for key in ("phases", "phases_int8"):
        for t in (1, 16):
            summary[f"{key}/{t}"] = {name: statistics.median(rd[f"{key}/{t}"][name] for rd in rounds)
                                     for name in rounds[0][f"{key}/{t}"]}
    out = {"meta": {"threads": args.threads, "rounds": args.rounds, "context": args.context, "weight_bytes": nbytes,
                    "variant": kernels.variant(), "int8_variant": torch.ops.specserve_cpu.int8_variant(),
                    "compiled_source": compiled.model.source},
           "rounds": rounds, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    _print_tables(summary, nbytes, args)
    return 0


def tree_ms(runner: Any, context: list[int], tokens: int, repeats: int = 15,
            profile: bool = False) -> float:
    """Median ms of a pass of a `tokens`-node chain over the context (after 3 warm-up passes); with
    `profile`, the operators' phase timers run over the timed passes only."""
    import torch

    from specserve.shared.runtime.batch import Chunk, Tree

    runner.forward([Chunk("ctx", context)])
    times = []
    for i in range(repeats):
        if profile and i == 3:
            torch.ops.specserve_cpu.profile(True)
        t0 = time.perf_counter()
        runner.forward([Tree("ctx", [5] * tokens, [-1, *range(tokens - 1)])])
        runner.discard_tree("ctx")
        times.append(time.perf_counter() - t0)
    runner.release("ctx")
    return statistics.median(times[3:]) * 1e3


def _variants_main(args: argparse.Namespace) -> int:
    """The compiled pass at T = 1 and 4 for each of args.variants, interleaved over args.rounds rounds."""
    import torch

    from specserve.shared.runtime import kernels
    from specserve.shared.runtime.model_store import resolve
    from specserve.shared.runtime.runner import ModelRunner

    torch.set_num_threads(args.threads)
    assert kernels.load(), kernels.error()
    names = args.variants.split(",")
    missing = [v for v in names if v not in kernels.variants()]
    assert not missing, f"this CPU cannot run {missing} (it runs {kernels.variants()})"
    runner = ModelRunner.from_dir(resolve("smollm2-135m-instruct"), num_blocks=256, kernels="cpu")
    context = [(i * 7) % 4000 + 10 for i in range(args.context)]

    rounds = []
    for r in range(args.rounds):
        row = {}
        for name in names:
            kernels.set_variant(name)
            repeats = 8 if name == "generic" else 15  # generic: about 0.6 s a pass
            for t in (1, 4):
                row[f"{name}/{t}"] = tree_ms(runner, context, t, repeats)
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()), flush=True)
    summary = {key: spread([rd[key] for rd in rounds]) for key in rounds[0]}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    out = {"meta": {"threads": args.threads, "rounds": args.rounds, "context": args.context, "cpu": cpu,
                    "cpu_runs": kernels.variants(), "compiled_source": runner.model.source},
           "rounds": rounds, "summary": summary}
    path = Path(args.out or ROOT / "bench" / "results" / "cpu_pass_variants.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    fmt = lambda key: f"{summary[key]['median']:.2f} ({summary[key]['min']:.2f}-{summary[key]['max']:.2f})"  # noqa: E731
    first = names[0]
    print(f"\n| variant | one token, ms | 4-token tree, ms | one token : {first} |")
    print("|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {fmt(f'{name}/1')} | {fmt(f'{name}/4')} | "
              f"{summary[f'{name}/1']['median'] / summary[f'{first}/1']['median']:.2f}x |")
    return 0


def _parallel_main(args: argparse.Namespace) -> int:
    """The compiled pass at T = 1 and 4 (float32 and int8 activations) for each thread count and parallel mode,
    quiet and beside a busy core, interleaved over args.rounds rounds."""
    import subprocess

    import torch

    from specserve.shared.runtime import kernels
    from specserve.shared.runtime.model_store import resolve
    from specserve.shared.runtime.runner import ModelRunner

    assert kernels.load(), kernels.error()
    modes = args.parallel.split(",")
    counts = [int(n) for n in args.thread_counts.split(",")]
    runner = ModelRunner.from_dir(resolve("smollm2-135m-instruct"), num_blocks=256, kernels="cpu")
    context = [(i * 7) % 4000 + 10 for i in range(args.context)]

    rounds = []
    for r in range(args.rounds):
        row = {}
        for load in ("quiet", "busy"):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
            try:
                time.sleep(0.2)
                for threads in counts:
                    torch.set_num_threads(threads)
                    for mode in modes:
                        kernels.set_parallel(mode)
                        for act in ("float32", "int8"):
                            runner.model.activations = act
                            for t in (1, 4):
                                row[f"{load}/{act}/{threads}/{mode}/{t}"] = tree_ms(runner, context, t, 13)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    summary = {key: spread([rd[key] for rd in rounds]) for key in rounds[0]}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    out = {"meta": {"rounds": args.rounds, "context": args.context, "cpu": cpu, "cores": os.cpu_count(),
                    "variant": kernels.variant(), "int8_variant": torch.ops.specserve_cpu.int8_variant(),
                    "thread_counts": counts, "modes": modes, "key": "load/activations/threads/mode/tokens, ms"},
           "rounds": rounds, "summary": summary}
    path = Path(args.out or ROOT / "bench" / "results" / "cpu_pass_threads.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    fmt = lambda key: f"{summary[key]['median']:.2f} ({summary[key]['min']:.2f}-{summary[key]['max']:.2f})"  # noqa: E731
    for act in ("float32", "int8"):
        print(f"\n{act} activations, ms (median of {args.rounds} rounds, min-max)")
        print("| machine | threads | split | one token | 4-token tree |")
        print("|---|---:|---|---:|---:|")
        for load in ("quiet", "busy"):
            for threads in counts:
                for mode in modes:
                    key = f"{load}/{act}/{threads}/{mode}"
                    print(f"| {load} | {threads} | {mode} | {fmt(key + '/1')} | {fmt(key + '/4')} |")
    return 0


def _print_tables(summary: dict, nbytes: int, args: argparse.Namespace) -> None:
    med = {k: v["median"] for k, v in summary.items() if "median" in v}
    fmt = lambda key: f"{summary[key]['median']:.2f} ({summary[key]['min']:.2f}-{summary[key]['max']:.2f})"  # noqa: E731
    print(f"\nweights read per pass {nbytes / 2**20:.1f} MiB; floor {fmt('floor_ms')} ms; threads {args.threads}")
    print("\n| tokens in the pass | compiled pass, ms | torch pass (float32), ms | products alone, torch int4 "
          "bf16, ms | compiled : torch |")
    print("|---:|---:|---:|---:|---:|")
    for t in TOKENS:
        print(f"| {t} | {fmt(f'compiled/{t}')} | {fmt(f'torch/{t}')} | {fmt(f'int4_bf16/{t}')} | "
              f"{med[f'compiled/{t}'] / med[f'torch/{t}']:.2f}x |")
    print("\n| tokens in the pass | float32 activations, ms | int8 activations, ms | int8 : float32 | int8 : floor | "
          "each extra token, of a one-token int8 pass |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t in TOKENS:
        extra = f"{med[f'int8_extra/{t}']:.2f} ({summary[f'int8_extra/{t}']['min']:.2f}-" \
                f"{summary[f'int8_extra/{t}']['max']:.2f})" if t > 1 else "-"
        print(f"| {t} | {fmt(f'compiled/{t}')} | {fmt(f'int8/{t}')} | {med[f'int8/{t}'] / med[f'compiled/{t}']:.2f}x | "
              f"{med[f'int8/{t}'] / med['floor_ms']:.2f}x | {extra} |")
    for key in ("phases", "phases_int8"):
        for t in (1, 16):
            phases = summary[f"{key}/{t}"]
            products = sum(phases[p] for p in MATMULS)
            print(f"\n{key} at T = {t}: products {products:.2f} ms, the rest {sum(phases.values()) - products:.2f} ms")
            for name, ms in sorted(phases.items(), key=lambda kv: -kv[1]):
                print(f"  {name:24s} {ms:7.3f} ms")
    print("\n| draft weights | step, ms | target pass : draft step |")
    print("|---|---:|---:|")
    for w in ("float32", "q8_0", "q4_1", "q8_0_int8", "q4_1_int8"):
        print(f"| {w} | {fmt(f'draft_{w}/1')} | {med['compiled/1'] / med[f'draft_{w}/1']:.1f} |")


def _bandwidth(torch) -> float:  # noqa: ANN001
    """Bytes per second one core reads: a float32 sum over 1 GiB, best of 5."""
    big = torch.ones(1 << 28)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        best = max(best, big.numel() * 4 / (time.perf_counter() - t0))
    return best


def _time_ms(fn, repeats: int = 15) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _int4_products(model, torch):  # noqa: ANN001, ANN202
    """A function of T running every projection of `model` and its head (as 4-bit weights too) through
    torch's int4 CPU kernel with bfloat16 activations: random 4-bit values of the same shapes, for the time
    only (the kernel's time does not depend on the values)."""
    weights = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.head]
    packed = []
    for w in weights:
        q = torch.randint(0, 16, (w.rows, w.cols), dtype=torch.int32)
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scales = torch.ones(w.cols // 32, w.rows, 2, dtype=torch.bfloat16)
        packed.append((pack, scales, w.cols))

    def run(tokens: int) -> None:
        xs: dict[int, torch.Tensor] = {}
        for pack, scales, cols in packed:
            x = xs.setdefault(cols, torch.randn(tokens, cols, dtype=torch.bfloat16))
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, pack, 32, scales)

    return run


if __name__ == "__main__":
    raise SystemExit(main())
