"""What the draft and target services share: common flags, thread setup, and the serving loop.

Each service has one config dataclass (services/<name>/config.py) starting from ServiceConfig's
common fields; each field is a flag and an environment variable SPECSERVE_<SERVICE>_<FIELD>
(specserve.shared.process.settings).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from specserve.shared.host.service_metrics import ServiceMetrics
from specserve.shared.process import tracing
from specserve.shared.process.collector import freeze_startup_objects
from specserve.shared.process.lifeline import follow_parent
from specserve.shared.process.ports import check_port_free
from specserve.shared.process.settings import Settings, option
from specserve.shared.runtime.loader import ACTIVATIONS, DTYPE_CHOICES, DTYPE_HELP, KERNELS, WEIGHTS
from specserve.shared.wire.auth import load_secret
from specserve.shared.wire.messages import Error, Health, HealthReply, Message, Release, ReleaseReply, Stats
from specserve.shared.wire.rpc import DEFAULT_FRAME_TIMEOUT_S, DEFAULT_HANDSHAKE_TIMEOUT_S, RpcServer
from specserve.shared.wire.transport import DEFAULT_MAX_FRAME_BYTES, Tensors, split_flat

log = logging.getLogger("specserve")


class BadCall(ValueError):
    """A call whose content does not add up (counts vs tensor sizes, wrong message type)."""


def default_threads() -> int:
    """Half the cores: the draft and target share a machine, and oversubscribing OpenMP threads
    across processes slows small kernels by orders of magnitude."""
    return max(1, (os.cpu_count() or 2) // 2)


@dataclass(slots=True, kw_only=True)
class ServiceConfig(Settings):
    """The fields every service's config dataclass starts with: its common flags.

    A service subclasses it, sets `env_prefix` (`SPECSERVE_<SERVICE>_`) and gives `model` and
    `port` their defaults with `override_default` (they have none here)."""

    model: str = option(help="Hugging Face model directory")
    device: str = option("cpu", "cpu or cuda[:N]")
    dtype: str = option("auto", DTYPE_HELP, choices=DTYPE_CHOICES)
    weights: str = option("auto", "which weights run: " + "; ".join(f"{k}: {v}" for k, v in WEIGHTS.items()),
                          choices=list(WEIGHTS))
    kernels: str = option("auto", "which pass runs them: " + "; ".join(f"{k}: {v}" for k, v in KERNELS.items()),
                          choices=list(KERNELS))
    activations: str = option("auto", "the compiled CPU pass's activations: " + "; ".join(
        f"{k}: {v}" for k, v in ACTIVATIONS.items()), choices=list(ACTIVATIONS))
    host: str = option("127.0.0.1", "TCP host to listen on")
    port: int = option(help="TCP port (0 picks a free one; the ready line names it)")
    unix_socket: str | None = option(None, "listen on this Unix socket path instead of TCP")
    kv_blocks: int = option(4096, "KV pool size, blocks")
    block_size: int = option(16, "tokens per KV block")
    prefix_caching: bool = option(True, "turn the prefix cache off (on by default: full KV blocks of committed "
                                  "tokens are kept after their request ends, evicted least recently used when an "
                                  "allocation needs the room, and a new prompt starts from its longest cached prefix)",
                                  negate=True)
    threads: int = option(default_factory=default_threads, help="torch intra-op threads",
                          default_text="half the cores")
    max_frame_mb: int = option(DEFAULT_MAX_FRAME_BYTES >> 20, "largest message accepted, MiB")
    frame_timeout_s: float = option(DEFAULT_FRAME_TIMEOUT_S, "a frame must be complete this long after its "
                                    "16-byte prefix, or the connection is dropped, seconds")
    metrics_port: int | None = option(None, "serve Prometheus /metrics (pass time, KV blocks, offload state) over "
                                      "HTTP on this port of --host, once the service is ready; off when unset")
    simulate: str | None = option(None, "no model: simulate the model passes with this preset's latency and "
                                  "acceptance models (a preset name or a .toml file; docs/simulation.md). "
                                  "--model then names only the tokenizer's directory (its config.json)")
    handshake_timeout_s: float = option(DEFAULT_HANDSHAKE_TIMEOUT_S, "a connection that has not authenticated "
                                        "with the shared secret this long after connecting is dropped, seconds")
    inline_tokens: int = option(64, "on CPU, a model call of at most this many tokens (Forward: prompt tokens + "
                                "tree nodes; Speculate: new tokens + depth x width per entry) runs on the event "
                                "loop's thread when the model thread is idle, saving two thread hops; larger calls "
                                "run on the model thread, so Health waits at most one such small call. 0: every "
                                "call runs on the model thread")

    @property
    def address(self) -> str:
        return f"unix:{self.unix_socket}" if self.unix_socket else f"{self.host}:{self.port}"


def latency_fingerprint(config: ServiceConfig, device: str, dtype: str) -> str:
    """What sets this service's pass latency, as one line: the model's files (names, sizes, modification
    times) or the simulation preset's file and time scale, the pass (weights, kernels, activations), device, dtype and
    threads. Health reports it; a gateway keys its cached profile by it (gateway/perf/profile.py)."""
    if config.simulate is not None:
        from specserve.shared.simulate.preset import resolve, split_spec

        name, scale = split_spec(config.simulate)
        source = f"simulate={hashlib.sha1(resolve(name).read_bytes()).hexdigest()[:12]},time_scale={scale!r}"
    else:
        root = Path(config.model)
        files = sorted(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in root.iterdir()
                       if p.is_file() and p.suffix in (".json", ".safetensors", ".gguf")) if root.is_dir() else []
        source = f"model={root.resolve().name}:{hashlib.sha1('|'.join(files).encode()).hexdigest()[:12]}"
    return (f"{source};weights={config.weights};kernels={config.kernels};activations={config.activations};"
            f"device={device};dtype={dtype};"
            f"threads={config.threads}")


class ServiceHost:
    """Runs one engine behind an RpcServer: model calls one at a time, in arrival order; health and
    stats are answered without waiting for the model.

    A model call runs on the one model thread, except a small one (`call_tokens(body)` at most
    `inline_tokens`) that arrives while that thread is idle: it runs at once on the event loop's
    thread. That saves the hop to the model thread and the hop back (two thread wake-ups, about a
    third of a call's overhead at one request, docs/lab/call_cost.md), and Health then waits at most
    one small pass. Calls never overlap: the inline path is taken only when every call handed to the
    model thread has finished. Only on CPU: on CUDA the engine's device and streams are the model
    thread's."""

    def __init__(self, name: str, model: str, device: str, dtype: str, handlers: dict[type, Callable],
                 stats: Callable[[], Message], status: Callable[[], str] = lambda: "ok",
                 call_tokens: Callable[[Message], int | None] = lambda _body: None, fingerprint: str = "",
                 reads_features: bool = False, tree_caps: tuple[int, int] = (0, 0)):
        """call_tokens: a call's size in tokens, from its message alone; None: never inline. fingerprint:
        `latency_fingerprint`, reported by Health. reads_features: a draft that reads the target's features.
        tree_caps: a draft's deepest and widest tree (--max-depth, --max-width), reported by Health."""
        self.name, self.model, self.device, self.dtype = name, model, device, dtype
        self.fingerprint, self.reads_features, self.tree_caps = fingerprint, reads_features, tree_caps
        self.stats, self.status, self.call_tokens = stats, status, call_tokens
        self.metrics = ServiceMetrics(name, stats)  # served only with --metrics-port
        self.handlers = {kind: self.metrics.timed(h, kind.__name__) for kind, h in handlers.items()}
        self.started = time.monotonic()
        # One worker thread: model calls run one at a time, in arrival order. Started now, not at the first
        # call, so that the process has all its threads from the start (a leak check holds it to that count).
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-model")
        self.executor.submit(lambda: None).result()
        self.inline_tokens = 0  # serve() sets --inline-tokens (on CPU)
        self._last: Future[Any] | None = None  # the call most recently handed to the model thread

    def _inline(self, body: Message) -> bool:
        if not self.inline_tokens or (self._last is not None and not self._last.done()):
            return False  # the model thread has a call (one thread, FIFO: the last one done means all are)
        tokens = self.call_tokens(body)
        return tokens is not None and tokens <= self.inline_tokens

    async def handle(self, body: Message, tensors: dict[str, torch.Tensor]) -> tuple[Message, Tensors | None]:
        if isinstance(body, Health):
            return HealthReply(self.name, self.status(), self.model, self.device, self.dtype,
                               round(time.monotonic() - self.started, 3), self.fingerprint,
                               self.reads_features, *self.tree_caps), None
        if isinstance(body, Stats):
            return self.stats(), None
        handler = self.handlers.get(type(body))
        if handler is None:
            return Error("unsupported", f"the {self.name} service does not handle {type(body).__name__}"), None
        try:
            if self._inline(body):
                return cast("tuple[Message, Tensors | None]", handler(body, tensors))
            self._last = self.executor.submit(handler, body, tensors)
            return cast("tuple[Message, Tensors | None]", await asyncio.wrap_future(self._last))
        except BadCall as exc:
            return Error("bad_message", str(exc)), None


def setup_process(config: ServiceConfig) -> bytes:
    """Before the model loads: follow the parent that started this service, if one did
    (lifeline.py); read the shared secret (none: SettingsError, exit 2); check that a fixed TCP port
    is free (PortInUse, exit 1); set the torch threads and logging. Returns the secret."""
    logging.basicConfig(level=os.environ.get("SPECSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    follow_parent()
    secret = load_secret()
    if not config.unix_socket:
        check_port_free(config.host, config.port)
    if config.metrics_port:
        check_port_free(config.host, config.metrics_port)
    torch.set_num_threads(config.threads)
    return secret


def serve(host: ServiceHost, config: ServiceConfig, secret: bytes) -> int:
    """Serve until SIGINT/SIGTERM. Prints one 'ready <service> <address>' line when listening.
    Traces its calls if the OTEL_* environment asks for it (shared/process/tracing.py)."""
    tracing.setup(host.name)
    host.inline_tokens = config.inline_tokens if host.device == "cpu" else 0

    async def main() -> None:
        server = RpcServer(host.handle, config.max_frame_mb << 20, secret=secret,
                           frame_timeout_s=config.frame_timeout_s, handshake_timeout_s=config.handshake_timeout_s)
        bound = await server.start(config.address)
        if config.metrics_port is not None:
            host.metrics.serve(config.host, config.metrics_port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        freeze_startup_objects()  # the model and torch out of the collector's walks
        print(f"ready {host.name} {bound}", flush=True)
        await stop.wait()
        await server.close()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:  # uvloop is a dependency, but serving still works without it
        asyncio.run(main())
    host.executor.shutdown(wait=True)
    tracing.shutdown()  # export the spans still buffered
    log.info("%s stopped", host.name)
    return 0


def release_handler(
    release: Callable[[str], bool], free_blocks: Callable[[], int]
) -> Callable[[Release, dict[str, torch.Tensor]], tuple[Message, None]]:
    def handle(msg: Release, _tensors: dict[str, torch.Tensor]) -> tuple[Message, None]:
        released: list[str] = []
        unknown: list[str] = []
        for rid in msg.rids:
            (released if release(rid) else unknown).append(rid)
        return ReleaseReply(released, unknown, free_blocks()), None

    return handle


_T = TypeVar("_T")


def exit_on_load_error(fn: Callable[[], _T]) -> _T:
    """Load a model, turning a bad model directory into one clear line and exit status 2."""
    from specserve.shared.runtime.model_config import ModelLoadError

    try:
        return fn()
    except (ModelLoadError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def split_counts(tensors: dict[str, torch.Tensor], name: str, counts: list[int]) -> list[list[int]]:
    """Cut a flat int tensor of the payload into per-entry lists."""
    return split_flat(flat_counts(tensors, name, counts), counts)


def flat_counts(tensors: dict[str, torch.Tensor], name: str, counts: list[int]) -> list[int]:
    """A flat int tensor of the payload as one list, checked to hold `counts` entries' tokens (no tensor: no
    tokens)."""
    flat = tensors.get(name)
    total = sum(counts)
    if any(c < 0 for c in counts):
        raise BadCall(f"negative token count in {counts}")
    if flat is None:
        if total:
            raise BadCall(f"the call lacks tensor {name!r}")
        return []
    if flat.dim() != 1 or flat.numel() != total or flat.dtype not in (torch.int32, torch.int64):
        raise BadCall(f"tensor {name!r} must be 1-D integer with {total} elements "
                      f"(got {flat.dtype} {list(flat.shape)})")
    return flat.tolist()
