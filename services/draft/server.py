"""`specserve draft`: the draft service process (one model, its KV cache, the beam speculation)."""

from __future__ import annotations

import argparse

from specserve.draft.config import DraftConfig
from specserve.shared.messages import Offload, Release, Reload, Speculate
from specserve.shared.service_base import ServiceHost, exit_on_load_error, release_handler, serve, setup_process


def build_host(config: DraftConfig) -> ServiceHost:
    from specserve.draft.engine import DraftEngine

    if config.simulate is not None:  # the model pass replaced by the preset's models (no weights)
        from specserve.draft.simulated import simulated_engine

        engine = exit_on_load_error(lambda: simulated_engine(config))
    else:
        engine = exit_on_load_error(lambda: DraftEngine(config))
    handlers = {
        Speculate: engine.speculate,
        Release: release_handler(engine.release, engine.free_blocks),
        Offload: engine.offload,
        Reload: engine.reload,
    }
    return ServiceHost("draft", config.model, str(engine.device), config.dtype, handlers, engine.stats,
                       status=lambda: "offloaded" if engine.runner is None else "ok")


def main(args: argparse.Namespace) -> int:
    config = DraftConfig.from_args(args)
    secret = setup_process(config)
    host = build_host(config)
    return serve(host, config, secret)
