"""`specserve draft`: the draft service process (one model, its KV cache, the beam speculation)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from specserve.draft.config import DraftConfig
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
from specserve.shared.wire.messages import Message, Offload, Release, Reload, Speculate


def build_host(config: DraftConfig) -> ServiceHost:
    from specserve.draft.eagle_engine import EagleDraftEngine
    from specserve.draft.eagle_head import is_eagle_dir
    from specserve.draft.engine import DraftEngine
    from specserve.draft.ngram import NGRAM, NgramDraftEngine
    from specserve.draft.replay import ReplayDraftEngine, is_replay

    engine: DraftEngine
    if config.simulate is not None:  # the model pass replaced by the preset's models (no weights)
        from specserve.draft.simulated import simulated_engine

        engine = exit_on_load_error(lambda: simulated_engine(config))
    elif config.model == NGRAM:  # no model: trees from the request's own tokens
        engine = NgramDraftEngine(config)
    elif is_replay(config.model):  # no model: a recording's greedy outputs, each token kept with probability alpha
        engine = exit_on_load_error(lambda: ReplayDraftEngine(config))
    elif is_eagle_dir(config.model):  # a head over the target's features, which the calls carry
        engine = exit_on_load_error(lambda: EagleDraftEngine(config))
    else:
        engine = exit_on_load_error(lambda: DraftEngine(config))
    handlers: dict[type, Callable[..., Any]] = {
        Speculate: engine.speculate,
        Release: release_handler(engine.release, engine.free_blocks),
        Offload: engine.offload,
        Reload: engine.reload,
    }
    dtype = dtype_name(config.dtype, engine.device)
    return ServiceHost("draft", config.model, str(engine.device), dtype, handlers, engine.stats,
                       status=lambda: "offloaded" if engine.runner is None else "ok", call_tokens=call_tokens,
                       fingerprint=latency_fingerprint(config, str(engine.device), dtype),
                       reads_features=engine.reads_features, tree_caps=(config.max_depth, config.max_width))


def call_tokens(body: Message) -> int | None:
    """A call's size as the entries claim it (ServiceHost runs small ones on the loop's thread); the
    beam steps of an entry count its depth x width nodes. Offload and Reload always go to the model thread."""
    if isinstance(body, Speculate):
        return sum(e.num_new + e.depth * e.width for e in body.entries)
    return 0 if isinstance(body, Release) else None


def main(args: argparse.Namespace) -> int:
    config = DraftConfig.from_args(args)
    config.model = resolve_or_exit(config.model)  # a named model: its directory, installed on first use
    secret = setup_process(config)
    host = build_host(config)
    return serve(host, config, secret)
