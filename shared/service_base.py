"""What the draft and target services share: common flags, thread setup, and the serving loop.

Each service has one config dataclass (services/<name>/config.py). Its common fields come from
the flags below, each with an environment variable SPECSERVE_<SERVICE>_<FLAG> as its default.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.shared.messages import Error, Health, HealthReply, Message, Release, ReleaseReply, Stats
from specserve.shared.rpc import RpcServer
from specserve.shared.transport import DEFAULT_MAX_FRAME_BYTES, Tensors, split_flat

MODELS = Path(__file__).resolve().parent.parent / "models"
log = logging.getLogger("specserve")


class BadCall(ValueError):
    """A call whose content does not add up (counts vs tensor sizes, wrong message type)."""


def default_threads() -> int:
    """Half the cores: the draft and target share a machine, and oversubscribing OpenMP threads
    across processes slows small kernels by orders of magnitude."""
    return max(1, (os.cpu_count() or 2) // 2)


def add_common_flags(parser: argparse.ArgumentParser, service: str, port: int, model: Path, kv_blocks: int) -> None:
    def env(flag: str, default):
        return os.environ.get(f"SPECSERVE_{service.upper()}_{flag.upper()}", default)

    parser.add_argument("--model", default=env("model", str(model)), help=f"Hugging Face model directory "
                        f"(env SPECSERVE_{service.upper()}_MODEL; default: the bundled demo {service})")
    parser.add_argument("--device", default=env("device", "cpu"), help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=env("dtype", "float32"), choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--host", default=env("host", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("port", port)), help="TCP port (0 picks a free one)")
    parser.add_argument("--unix-socket", default=env("unix_socket", None),
                        help="listen on this Unix socket path instead of TCP")
    parser.add_argument("--kv-blocks", type=int, default=int(env("kv_blocks", kv_blocks)),
                        help="KV pool size in blocks")
    parser.add_argument("--block-size", type=int, default=int(env("block_size", 16)), help="tokens per KV block")
    parser.add_argument("--threads", type=int, default=int(env("threads", default_threads())),
                        help="torch intra-op threads")
    parser.add_argument("--max-frame-mb", type=int, default=int(env("max_frame_mb", DEFAULT_MAX_FRAME_BYTES >> 20)),
                        help="largest message accepted, MiB")


@dataclass(slots=True)
class ServiceConfig:
    """The fields every service's config dataclass starts with (the common flags above)."""

    model: str  # Hugging Face model directory
    device: str  # "cpu" or "cuda[:N]"
    dtype: str  # "float32", "bfloat16" or "float16"
    host: str
    port: int  # TCP port; 0 picks a free one (printed on the ready line)
    unix_socket: str | None  # listen on this path instead of TCP
    kv_blocks: int  # KV pool size, blocks
    block_size: int  # tokens per KV block
    threads: int  # torch intra-op threads
    max_frame_mb: int  # largest accepted message, MiB

    @property
    def address(self) -> str:
        return f"unix:{self.unix_socket}" if self.unix_socket else f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


class ServiceHost:
    """Runs one engine behind an RpcServer: model work on one worker thread, one call at a time;
    health and stats are answered without waiting for the model."""

    def __init__(self, name: str, model: str, device: str, dtype: str, handlers: dict[type, Callable],
                 stats: Callable[[], Message], status: Callable[[], str] = lambda: "ok"):
        self.name, self.model, self.device, self.dtype = name, model, device, dtype
        self.handlers, self.stats, self.status = handlers, stats, status
        self.started = time.monotonic()
        # One worker thread: model calls run one at a time, in arrival order.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-model")

    async def handle(self, body: Message, tensors: dict[str, torch.Tensor]) -> tuple[Message, Tensors | None]:
        if isinstance(body, Health):
            return HealthReply(self.name, self.status(), self.model, self.device, self.dtype,
                               round(time.monotonic() - self.started, 3)), None
        if isinstance(body, Stats):
            return self.stats(), None
        handler = self.handlers.get(type(body))
        if handler is None:
            return Error("unsupported", f"the {self.name} service does not handle {type(body).__name__}"), None
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, handler, body, tensors)
        except BadCall as exc:
            return Error("bad_message", str(exc)), None


def setup_process(threads: int) -> None:
    torch.set_num_threads(threads)
    logging.basicConfig(level=os.environ.get("SPECSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def serve(host: ServiceHost, address: str, max_frame_bytes: int) -> int:
    """Serve until SIGINT/SIGTERM. Prints one 'ready <service> <address>' line when listening."""

    async def main() -> None:
        server = RpcServer(host.handle, max_frame_bytes)
        bound = await server.start(address)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"ready {host.name} {bound}", flush=True)
        await stop.wait()
        await server.close()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:  # uvloop is a dependency, but serving still works without it
        asyncio.run(main())
    host.executor.shutdown(wait=True)
    log.info("%s stopped", host.name)
    return 0


def release_handler(release: Callable[[str], bool], free_blocks: Callable[[], int]):
    def handle(msg: Release, _tensors) -> tuple[Message, None]:
        released, unknown = [], []
        for rid in msg.rids:
            (released if release(rid) else unknown).append(rid)
        return ReleaseReply(released, unknown, free_blocks()), None

    return handle


def exit_on_load_error(fn: Callable[[], object]):
    """Load a model, turning a bad model directory into one clear line and exit status 2."""
    from specserve.shared.model_config import ModelLoadError

    try:
        return fn()
    except (ModelLoadError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def split_counts(tensors: dict[str, torch.Tensor], name: str, counts: list[int]) -> list[list[int]]:
    """Cut a flat int tensor of the payload into per-entry lists."""
    flat = tensors.get(name)
    total = sum(counts)
    if any(c < 0 for c in counts):
        raise BadCall(f"negative token count in {counts}")
    if flat is None:
        if total:
            raise BadCall(f"the call lacks tensor {name!r}")
        return [[] for _ in counts]
    if flat.dim() != 1 or flat.numel() != total or flat.dtype not in (torch.int32, torch.int64):
        raise BadCall(f"tensor {name!r} must be 1-D integer with {total} elements "
                      f"(got {flat.dtype} {list(flat.shape)})")
    return split_flat(flat.tolist(), counts)
