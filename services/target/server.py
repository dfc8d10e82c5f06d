"""`specserve target`: the target service process (one model, its KV cache, batched tree verification)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from specserve.shared.host.service_base import (
    ServiceHost,
    exit_on_load_error,
    latency_fingerprint,
    release_handler,
    serve,
    setup_process,
)
from specserve.shared.runtime.loader import dtype_name
from specserve.shared.runtime.model_store import resolve_or_exit
from specserve.shared.wire.messages import Forward, Message, Release
from specserve.target.config import TargetConfig


def build_host(config: TargetConfig) -> ServiceHost:
    from specserve.target.engine import TargetEngine

    if config.simulate is not None:  # the model pass replaced by the preset's models (no weights)
        from specserve.target.simulated import simulated_engine

        engine = exit_on_load_error(lambda: simulated_engine(config))
    else:
        engine = exit_on_load_error(lambda: TargetEngine(config))
    handlers: dict[type, Callable[..., Any]] = {
        Forward: engine.forward,
        Release: release_handler(engine.release, engine.free_blocks),
    }
    dtype = dtype_name(config.dtype, engine.device)
    return ServiceHost("target", config.model, str(engine.device), dtype, handlers, engine.stats,
                       call_tokens=call_tokens, fingerprint=latency_fingerprint(config, str(engine.device), dtype))


def call_tokens(body: Message) -> int | None:
    """A call's size as the entries claim it (ServiceHost runs small ones on the loop's thread)."""
    if isinstance(body, Forward):
        try:
            nodes = int(body.verify.arrays()[2].sum())
        except ValueError:  # malformed columns: the engine refuses the call
            return None
        return sum(e.num_tokens for e in body.prefill) + nodes
    return 0 if isinstance(body, Release) else None


def main(args: argparse.Namespace) -> int:
    config = TargetConfig.from_args(args)
    config.model = resolve_or_exit(config.model)  # a named model: its directory, installed on first use
    secret = setup_process(config)
    host = build_host(config)
    return serve(host, config, secret)
