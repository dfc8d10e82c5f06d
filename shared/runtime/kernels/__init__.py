"""specserve's compiled CPU operators (cpu_ops.cpp), built once with torch.utils.cpp_extension and cached.

`load()` builds the extension on first use (about 10-20 s with gcc; `specserve kernels build` does it
ahead, and scripts/run.sh calls that) into `build_dir()`, and registers `torch.ops.specserve_cpu.*`.
A later process finds the build there (torch rebuilds only when the source changes). Where it cannot
be built (no compiler, a build error), `load()` returns False once with the reason in `error()`, and
the model runs its torch pass instead.

The operators (see cpu_ops.cpp for their exactness rules):
- `linear(x, weight, kind, cols, bias, activations)`: x [T, cols] float32 times a weight as stored (KIND_*);
  activations ACT_INT8 multiplies Q4_1 / Q8_0 weights on x quantized to int8 per token per 32-wide block
  (ACT_F32, the default: float32 products);
- `embed(ids, weight, kind, cols)`: rows of an embedding as stored, dequantized;
- `rms_norm(x, weight, eps)`;
- `decoder_layers(..., activations)`: every decoder layer of a Llama-family model over one pass, in one call;
- `variant()`: the code the operators run, "avx512", "avx2" (AVX2 + FMA + F16C) or "generic" (plain C++);
  `variants()`: those this CPU runs; `set_variant(name)`: switch within this process (tests);
- `int8_variant()`: the int8 products' code: "avx512_vnni", "avx2" or "generic"
  (SPECSERVE_CPU_INT8_VARIANT=avx2 / generic picks a lesser one); weights packed in panels
  (KIND_Q8_0P / KIND_Q4_1P, quant.py `panels`) run on int8 activations only, fastest with "avx512_vnni".
- `set_parallel(name)`: how the matrix products and attention split their work over torch's intra-op
  threads: "pool" (the default: the library's worker pool, where threads take chunks from a shared counter
  and the caller computes what no thread took, so a descheduled thread holds nobody up) or "openmp"
  (at::parallel_for, for measurements).

The best variant the CPU runs is chosen when the library loads. SPECSERVE_CPU_KERNELS_VARIANT=avx512|avx2|generic
forces one (SPECSERVE_CPU_KERNELS_GENERIC=1 is an alias of =generic); one this CPU lacks, or an unknown name,
runs the best it has instead, with a warning logged by `load()`.

On x86 the library is built for baseline x86-64 and picks its AVX-512 or AVX2 code at run time, so one build
serves every x86 machine. Elsewhere (aarch64: NEON) the generic code is built for the building machine's CPU
(-mcpu=native), so the build folder is keyed by the CPU (`isa_tag()`): a build made on one machine is never
loaded on another that shares the cache (a home directory, a Docker image).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KIND_F32, KIND_Q8_0, KIND_Q4_1 = 0, 1, 2
KIND_Q8_0P, KIND_Q4_1P = 3, 4  # the same blocks packed in panels of PANEL rows, for int8 activations on AVX-512 VNNI
PANEL = 16
ACT_F32, ACT_INT8 = 0, 1  # activation modes of `linear` and `decoder_layers`
SOURCE = Path(__file__).with_name("cpu_ops.cpp")
NAME = "specserve_cpu"
VARIANTS = ("avx512", "avx2", "generic")
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# -ffp-contract=off: no mul+add is fused behind our back (dequantization must round as gguf-py does).
# Off x86, the generic code is vectorized for this machine's CPU (NEON on aarch64).
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"] + ([] if X86 else ["-mcpu=native"])

_lock = threading.Lock()
_state: dict[str, object] = {}


def isa_tag() -> str:
    """What a build is specific to: "x86_64" (one build runs on every x86-64 CPU); elsewhere the machine and a
    short hash of this CPU's model and feature flags (/proc/cpuinfo), as the build targets this CPU."""
    machine = platform.machine().lower() or "unknown"
    if X86:
        return machine
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = [platform.processor()]
    keys = ("features", "flags", "cpu implementer", "cpu architecture", "cpu variant", "cpu part", "model name", "isa")
    described = sorted({line.strip() for line in lines if line.lower().startswith(keys)})
    return f"{machine}-{hashlib.sha256(chr(10).join(described).encode()).hexdigest()[:10]}"


def build_dir() -> Path:
    """$SPECSERVE_KERNELS_DIR, else ~/.cache/specserve/kernels; then torch-<version>-<isa_tag()>."""
    env = os.environ.get("SPECSERVE_KERNELS_DIR")
    base = Path(env) if env else Path.home() / ".cache" / "specserve" / "kernels"
    return base / f"torch-{torch.__version__.split('+')[0]}-{isa_tag()}"


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Held while torch builds or loads the operators in `target`: an flock on `target/specserve.lock`, which the
    kernel releases when its holder dies. torch's own lock file there (`lock`, which a killed build leaves
    behind and every later build or load then waits on for ever) can only be stale while this is held: it is
    removed."""
    with open(target / "specserve.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            baton = target / "lock"
            if baton.exists():
                log.warning("removing %s, left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def load(verbose: bool = False) -> bool:
    """Build (once) and load the operators; False, with `error()` set, where that fails."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("SPECSERVE_CPU_KERNELS") == "off":
            _state.update(ok=False, error="turned off by SPECSERVE_CPU_KERNELS=off")
            return False
        try:
            from torch.utils import cpp_extension

            target = build_dir()
            target.mkdir(parents=True, exist_ok=True)
            with build_lock(target):
                cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                   extra_ldflags=["-fopenmp"], build_directory=str(target), is_python_module=False,
                                   verbose=verbose)
            _state.update(ok=True, error=None)
            requested = os.environ.get("SPECSERVE_CPU_KERNELS_VARIANT")
            if requested and requested != variant():
                log.warning("SPECSERVE_CPU_KERNELS_VARIANT=%s: %s; running %s", requested,
                            "not a variant (avx512, avx2, generic)" if requested not in VARIANTS
                            else "this CPU cannot run it", variant())
        except Exception as exc:  # any build or load failure: the torch pass runs instead
            lines = [line for line in str(exc).splitlines() if "error" in line.lower()] or str(exc).splitlines()
            _state.update(ok=False, error=f"{type(exc).__name__}: {' | '.join(lines[:3])[:600]}")
            log.warning("specserve CPU kernels unavailable, using the torch pass: %s", _state["error"])
        return bool(_state["ok"])


def error() -> str | None:
    """Why `load()` returned False (None before the first call or after a success)."""
    value = _state.get("error")
    return None if value is None else str(value)


def variant() -> str:
    """Which code the operators run: "avx512", "avx2" or "generic" (load() must have succeeded)."""
    return str(torch.ops.specserve_cpu.variant())


def variants() -> list[str]:
    """The variants this CPU runs, best last (load() must have succeeded)."""
    return [str(v) for v in torch.ops.specserve_cpu.variants()]


def set_variant(name: str) -> str:
    """Run variant `name` from now on in this process; returns the one that ran before. RuntimeError where
    `name` is unknown or this CPU cannot run it."""
    return str(torch.ops.specserve_cpu.set_variant(name))


def set_parallel(name: str) -> str:
    """Split the operators' parallel loops by "pool" (the default) or "openmp" (at::parallel_for) from now on in
    this process; returns the mode used before. RuntimeError for another name (load() must have succeeded)."""
    return str(torch.ops.specserve_cpu.set_parallel(name))


def main() -> int:
    """`specserve kernels build`: build now, saying so, and exit 0 even where it fails (a fallback exists)."""
    if not (build_dir() / f"{NAME}.so").is_file():
        print(f"[specserve] building the CPU kernels into {build_dir()} (once; about 30 s)", file=sys.stderr,
              flush=True)
    if load():
        print(f"[specserve] CPU kernels ready ({variant()})", file=sys.stderr, flush=True)
    else:
        print(f"[specserve] CPU kernels not built, the torch pass will run: {error()}", file=sys.stderr, flush=True)
    return 0
