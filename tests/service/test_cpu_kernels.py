"""The compiled CPU operators (shared/runtime/kernels) and the weights they multiply as stored (runtime/quant.py).

Here: the tests that start one or two services or processes, or open sockets (among them: the worker pool
and at::parallel_for give bit-identical products and tree logits under 1, 2, 3 and more threads than
cores, beside a process busy on a core); the others are in tests/unit/test_cpu_kernels.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specserve.shared.runtime import kernels
from specserve.shared.runtime.batch import Chunk, Tree
from specserve.shared.runtime.kernels import ACT_F32, ACT_INT8, KIND_Q4_1, KIND_Q8_0
from specserve.shared.runtime.quant import quantize
from specserve.shared.runtime.random_model import TINY_CONFIG
from tests.support.gguf_model import VARIANTS, linear, small_runner

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU operators not built: {kernels.error()}")


@pytest.mark.parametrize("env", [{"SPECSERVE_CPU_KERNELS_VARIANT": v} for v in ("avx512", "avx2", "generic")]
                         + [{"SPECSERVE_CPU_KERNELS_GENERIC": "1"}, {"SPECSERVE_CPU_KERNELS_VARIANT": "sse9"}])
def test_the_environment_picks_the_variant(tmp_path, env):
    """SPECSERVE_CPU_KERNELS_VARIANT starts a process with that variant (SPECSERVE_CPU_KERNELS_GENERIC=1 with
    generic): the same products within float32 rounding, batch invariant; a name this CPU cannot run (or
    no variant at all) runs the best one it has, with a warning."""
    name = env.get("SPECSERVE_CPU_KERNELS_VARIANT", "generic")
    expected = name if name in VARIANTS else VARIANTS[-1]
    script = tmp_path / "variant.py"
    script.write_text(
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from specserve.shared.runtime import kernels\n"
        "from specserve.shared.runtime.quant import quantize, dequantize\n"
        "assert kernels.load(), kernels.error()\n"
        "print(kernels.variant())\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for kind in (0, 1, 2):\n"
        "    w = quantize(torch.randn(19, 96, generator=g), kind)\n"
        "    x = torch.randn(6, 96, generator=g)\n"
        "    y = torch.ops.specserve_cpu.linear(x, w.data, w.scales, w.kind, w.cols, None)\n"
        "    torch.testing.assert_close(y.double(), x.double() @ dequantize(w).double().T, rtol=1e-5, atol=1e-5)\n"
        "    one = torch.ops.specserve_cpu.linear(x[2:3], w.data, w.scales, w.kind, w.cols, None)\n"
        "    assert torch.equal(one[0], y[2])\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_CPU_KERNELS_")}
    out = subprocess.run([sys.executable, str(script)], env={**clean, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == expected, (out.stdout, out.stderr[-2000:])
    assert ("SPECSERVE_CPU_KERNELS_VARIANT=" in out.stderr) == (expected != name), out.stderr[-2000:]


def test_the_int8_variants_agree_bit_for_bit(tmp_path):
    """SPECSERVE_CPU_INT8_VARIANT=avx2 / generic (each in a process of its own: the choice is made once)
    give exactly this process's products."""
    script = tmp_path / "variant.py"
    script.write_text(
        "import sys, torch\n"
        "from specserve.shared.runtime import kernels\n"
        "from specserve.shared.runtime.quant import quantize\n"
        "assert kernels.load()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "out = {}\n"
        "for kind in (1, 2):\n"
        "    for cols in (32, 96, 576, 1536):\n"
        "        w = quantize(torch.randn(37, cols, generator=g) * 0.1, kind)\n"
        "        x = torch.randn(9, cols, generator=g)\n"
        "        out[f'{kind}/{cols}'] = torch.ops.specserve_cpu.linear(x, w.data, w.scales, w.kind, w.cols, None, 1)\n"
        "torch.save(out, sys.argv[1])\n"
        "print(torch.ops.specserve_cpu.int8_variant())\n")
    results = {}
    for variant in ("", "avx2", "generic"):
        env = {**os.environ, "SPECSERVE_CPU_INT8_VARIANT": variant}
        path = tmp_path / f"{variant or 'default'}.pt"
        out = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        results[out.stdout.strip()] = torch.load(path)
    assert {"avx2", "generic"} <= set(results), results.keys()
    first, *others = results.values()
    for other in others:
        assert all(torch.equal(first[k], other[k]) for k in first)


# ---- a whole model from a GGUF file --------------------------------------------------------------


def test_without_the_operators_the_torch_pass_runs(gguf_model, tmp_path):
    script = tmp_path / "off.py"
    script.write_text(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from specserve.shared.runtime.runner import ModelRunner\n"
        "from specserve.shared.runtime.model import CausalLM\n"
        "r = ModelRunner.from_dir(sys.argv[1], num_blocks=8)\n"
        "assert isinstance(r.model, CausalLM)\n"
        "try:\n"
        "    ModelRunner.from_dir(sys.argv[1], num_blocks=8, kernels='cpu')\n"
        "except Exception as exc:\n"
        "    print('refused:', exc)\n")
    env = {**os.environ, "SPECSERVE_CPU_KERNELS": "off"}
    out = subprocess.run([sys.executable, str(script), str(gguf_model)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch pass, not model.gguf's blocks" in out.stderr and "SPECSERVE_CPU_KERNELS=off" in out.stderr
    assert "refused:" in out.stdout and "cannot run this model" in out.stdout


@pytest.fixture
def busy_core():
    """A process spinning on a core while the test runs (the machine's other services, in miniature)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


def _with_threads(threads: int, parallel: str, fn):
    before_threads, before_mode = torch.get_num_threads(), kernels.set_parallel(parallel)
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before_threads)
        kernels.set_parallel(before_mode)


@pytest.mark.parametrize("act", [ACT_F32, ACT_INT8])
def test_products_are_bit_identical_over_threads_and_a_busy_core(act, busy_core):
    """1, 2, 3 and (more than the cores) 2 * cores + 1 threads, by the pool and by at::parallel_for, with a
    process spinning beside them: the same bits as one thread."""
    gen = torch.Generator().manual_seed(21)
    weights = [quantize(torch.randn(1000, 576, generator=gen), kind) for kind in (KIND_Q8_0, KIND_Q4_1)]
    x = torch.randn(5, 576, generator=gen)
    alone = [_with_threads(1, "pool", lambda w=w: linear(x, w, act=act)) for w in weights]
    for threads in (1, 2, 3, 2 * (os.cpu_count() or 1) + 1):
        for parallel in ("pool", "openmp"):
            for w, ref in zip(weights, alone):
                for _ in range(3):
                    got = _with_threads(threads, parallel, lambda w=w: linear(x, w, act=act))
                    assert torch.equal(got, ref), (threads, parallel)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_tree_logits_are_bit_identical_over_threads_and_a_busy_core(gguf_model, activations, busy_core):
    """A 6-node tree over a committed context: the same logits under 1, 2, 3 and 2 * cores + 1 threads, by
    the pool and by at::parallel_for (attention and the products), with a process spinning beside them."""
    gen = torch.Generator().manual_seed(22)
    context = torch.randint(0, TINY_CONFIG["vocab_size"], (11,), generator=gen).tolist()
    tokens = torch.randint(0, TINY_CONFIG["vocab_size"], (6,), generator=gen).tolist()
    parents = [-1, 0, 1, 0, 3, 2]
    runner = small_runner(gguf_model, activations=activations)

    def tree() -> torch.Tensor:
        runner.forward([Chunk("r", context)])
        (logits,) = runner.forward([Tree("r", tokens, parents)])
        runner.discard_tree("r")
        runner.release("r")
        return logits

    ref = _with_threads(1, "pool", tree)
    for threads in (1, 2, 3, 2 * (os.cpu_count() or 1) + 1):
        for parallel in ("pool", "openmp"):
            assert torch.equal(_with_threads(threads, parallel, tree), ref), (threads, parallel)


def test_set_parallel_refuses_unknown_modes():
    with pytest.raises(RuntimeError, match="unknown parallel mode"):
        kernels.set_parallel("tbb")
    assert kernels.set_parallel("pool") == "pool"
