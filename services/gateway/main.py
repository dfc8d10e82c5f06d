"""The gateway process: `specserve gateway` builds the engine and its HTTP front end and runs them.

`run` wires one engine process: the tokenizer and model facts, the profile (measured now if missing),
the SLO classes, the replica pool and draft, the scheduler with its admission and router, the Engine,
and then HTTP in this process or in `--frontends N` processes of their own. `run_frontend` is one such
front end (`--frontend-of`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from specserve.gateway.backends.discovery import Resolver, TargetDiscovery
from specserve.gateway.backends.discovery import stop as stop_discovery
from specserve.gateway.backends.pool import DraftService, ServicePool, TargetReplica
from specserve.gateway.config import GatewayConfig
from specserve.gateway.engine.grammar import Grammars
from specserve.gateway.engine.loop import Engine
from specserve.gateway.frontend.local import LocalEngine
from specserve.gateway.http.api import ModelInfo
from specserve.gateway.http.server import Gateway
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.admission.slo import SloAdmission
from specserve.gateway.sched.policy import Policy, make_policy, option_classes
from specserve.gateway.sched.routing import make_router
from specserve.gateway.sched.scheduler import Scheduler
from specserve.gateway.sched.slo_classes import default_classes, parse_class
from specserve.shared.process import tracing
from specserve.shared.process.collector import freeze_startup_objects
from specserve.shared.process.lifeline import follow_parent
from specserve.shared.process.loop_tasks import LoopTasks
from specserve.shared.process.ports import check_port_free, port_in_use_as_error
from specserve.shared.runtime.model_store import resolve_or_exit
from specserve.shared.wire.auth import AuthError, load_secret

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("specserve.gateway")
ENGINE_WAIT_S = 120.0  # a front end waits this long for its engine's link to accept it


async def load_cost(config: GatewayConfig, vocab_size: int,
                       target: str) -> tuple[Callable[[], PassCost], Path]:
    """The profile (budget B, baseline latency, curve); measured against the target now if missing."""
    from specserve.gateway.perf import profile as profiling
    from specserve.shared.wire.service_client import TargetClient

    client = await TargetClient.connect(target)
    try:
        fingerprint = (await client.health()).fingerprint
        path = (Path(config.profile) if config.profile
                else profiling.default_profile_path(config.model, config.device, fingerprint))
        if path.is_file():
            prof = profiling.Profile.load(path)
            if prof.fingerprint and fingerprint and prof.fingerprint != fingerprint:
                print(f"warning: the profile {path} was measured on a target unlike this one ({prof.fingerprint}; "
                      f"this one: {fingerprint}); its budget and SLO classes may not fit. Leave out --profile to "
                      "use one measured on this target.", file=sys.stderr, flush=True)
        else:
            print(f"no profile at {path}: measuring the target now (specserve profile)", file=sys.stderr, flush=True)
            prof = await profiling.measure(client, vocab_size=vocab_size)
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.model, prof.device = config.model, config.device
            prof.save(path)
            print(f"profile saved to {path}: B = {prof.budget_tokens} tokens, baseline iteration "
                  f"{prof.baseline_iteration_ms:.2f} ms", file=sys.stderr, flush=True)
    finally:
        await client.close()
    budget = config.budget if config.budget else prof.budget_tokens
    return (lambda: PassCost(budget, prof.baseline_iteration_ms, list(prof.curve), single=list(prof.single))), path


def model_info(config: GatewayConfig) -> tuple[PreTrainedTokenizerBase, ModelInfo]:
    from transformers import AutoTokenizer

    from specserve.shared.host.service_base import exit_on_load_error
    from specserve.shared.runtime.model_config import ModelConfig

    cfg = exit_on_load_error(lambda: ModelConfig.from_dir(config.model))
    tokenizer = exit_on_load_error(lambda: AutoTokenizer.from_pretrained(config.model))
    stops = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    defaults = exit_on_load_error(lambda: sampling_defaults(config))
    return tokenizer, ModelInfo(config.served_model_name or config.model, cfg.max_position_embeddings, cfg.vocab_size,
                                frozenset(stops), defaults)


def sampling_defaults(config: GatewayConfig) -> dict[str, float | int]:
    """The model's own defaults for the sampling fields a request leaves out (--generation-config)."""
    from specserve.shared.runtime.generation_defaults import GENERATION_CONFIG, generation_defaults
    from specserve.shared.runtime.model_config import ModelLoadError

    if config.generation_config == "vllm":
        return {}
    if config.generation_config == "auto":
        return generation_defaults(config.model)
    if not (Path(config.generation_config) / GENERATION_CONFIG).is_file():
        raise ModelLoadError(f"--generation-config {config.generation_config}: no {GENERATION_CONFIG} there")
    return generation_defaults(config.generation_config)


async def run(config: GatewayConfig, policy: Policy) -> int:
    tracing.setup("gateway")  # on if OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT is set (shared/process/tracing.py)
    tokenizer, info = model_info(config)
    resolver = Resolver(config.hosts_file)
    discovery = TargetDiscovery(config.target, resolver, config.discovery_interval_s)
    addresses = list(config.target)
    if config.discover_targets:
        found = await discovery.addresses()
        if not found:
            raise ConnectionError(f"the target names {config.target} resolve to no address")
        addresses = found
    new_cost, profile_path = await load_cost(config, info.vocab_size, addresses[0])
    cost = new_cost()
    classes = default_classes(cost.baseline_iteration_ms)
    for spec in config.slo_classes:
        cls = parse_class(spec)
        classes[cls.name] = cls
    targets = [TargetReplica(i, address, new_cost()) for i, address in enumerate(addresses)]
    draft = DraftService(await resolver.first(config.draft)) if policy.uses_draft else None
    pool = ServicePool(targets, draft, new_cost)
    admission = SloAdmission(route_all=config.router == "slo") if config.admission == "slo" else None
    scheduler = Scheduler(policy, make_router(config.router), sync_draft=config.draft_sync == "eager",
                          admission=admission)
    metrics = GatewayMetrics(info.name)
    metrics.prime_tiers(classes)  # every tier's labelled series, at 0
    metrics.registry.register(LoopTasks("specserve:asyncio_tasks", "Tasks alive on the engine process's event loop.",
                                        {"model_name": info.name}, asyncio.get_running_loop()))
    engine = Engine(policy, scheduler, pool, metrics, config)
    await engine.start()
    rediscover = discovery.start(pool.set_addresses) if config.discover_targets else None
    grammars = Grammars(tokenizer, info.vocab_size, info.stop_ids)  # structured output, compiled on first use
    local = LocalEngine(engine, classes, profile_path, grammars)
    link = await _open_link(config.frontend_link, local) if config.frontend_link else None
    if config.frontends > 0:
        serving = await _start_frontends(config, local)
    else:
        serving = await _serve_http(config, Gateway(config, tokenizer, info, local, grammars), reuse_port=False)
    log.info("policy %s, budget B = %d tokens, baseline %.2f ms, classes %s", policy.name, cost.budget_tokens,
             cost.baseline_iteration_ms, {n: c.tpot_ms for n, c in classes.items()})
    await _until_stopped()
    await stop_discovery(rediscover)
    await serving()
    if link is not None:
        link.close()
    await engine.close()
    tracing.shutdown()  # export the spans still buffered
    return 0


async def _serve_http(config: GatewayConfig, gateway: Gateway, reuse_port: bool,
                      role: str = "gateway") -> Callable[[], Awaitable[None]]:
    """The HTTP server on config.host:port, the ready line; returns its cleanup."""
    # keepalive_timeout also bounds a new connection that does not finish a request head (slow headers)
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=config.client_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=reuse_port or None)
    with port_in_use_as_error(config.port):
        await site.start()
    port = runner.addresses[0][1]
    freeze_startup_objects()
    print(f"ready {role} http://{config.host}:{port}", flush=True)
    return runner.cleanup


async def _start_frontends(config: GatewayConfig, local: LocalEngine) -> Callable[[], Awaitable[None]]:
    """--frontends N: the link on a Unix socket in a private directory, then N front ends on one port."""
    from specserve.gateway.frontend.link import FrontendLink
    from specserve.gateway.frontend.procs import Frontends, frontend_command
    from specserve.shared.host.launch import free_port

    directory = tempfile.mkdtemp(prefix="specserve-frontends-")
    address = "unix:" + os.path.join(directory, "engine.sock")
    server = await FrontendLink(local, load_secret()).start(address)
    port = config.port or free_port(config.host)
    frontends = Frontends(config.frontends, frontend_command(sys.argv, port, address))
    await frontends.start()
    freeze_startup_objects()
    print(f"ready gateway http://{config.host}:{port}", flush=True)

    async def cleanup() -> None:
        await frontends.stop()
        server.close()
        shutil.rmtree(directory, ignore_errors=True)

    return cleanup


async def _open_link(address: str, local: LocalEngine) -> asyncio.Server:
    """--frontend-link HOST:PORT: the engine also serves front ends run on their own there."""
    from specserve.gateway.frontend.link import FrontendLink

    server = await FrontendLink(local, load_secret()).start(address)
    log.info("front ends are accepted at %s (they prove the shared secret)", address)
    return server


async def run_frontend(config: GatewayConfig) -> int:
    """One front end (--frontend-of): HTTP, tokenization and streaming for the engine process."""
    from specserve.gateway.frontend.remote import RemoteEngine

    tracing.setup("gateway-frontend")
    tokenizer, info = model_info(config)
    assert config.frontend_of is not None
    try:
        remote = await RemoteEngine.connect_retrying(config.frontend_of, load_secret(), ENGINE_WAIT_S)
    except AuthError as exc:
        print(f"error: cannot authenticate to the engine at {config.frontend_of}: {exc}", file=sys.stderr)
        return 1
    except ConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    cleanup = await _serve_http(config, Gateway(config, tokenizer, info, remote), reuse_port=True, role="frontend")
    stopped = asyncio.ensure_future(_until_stopped())
    gone = asyncio.ensure_future(remote.closed.wait())
    await asyncio.wait([stopped, gone], return_when=asyncio.FIRST_COMPLETED)
    for task in (stopped, gone):
        task.cancel()
    await cleanup()
    await remote.close()
    tracing.shutdown()
    return 0 if stopped.done() and not gone.done() else 1


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=os.environ.get("SPECSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = GatewayConfig.from_args(args)
    config.model = resolve_or_exit(config.model)  # a named model: its directory (its tokenizer, its name)
    try:
        policy = make_policy(config.policy, {cls: cls.from_args(args) for cls in option_classes()})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    follow_parent()  # started by `specserve up` (or a front end by its engine process): die with it
    import uvloop

    load_secret()  # the services' shared secret: none is one line and exit 2, before anything loads
    if config.frontend_of:  # no port check: front ends share their port (SO_REUSEPORT)
        return uvloop.run(run_frontend(config))
    check_port_free(config.host, config.port)  # taken: one line and exit 1 (the bind says the same)
    import torch

    torch.set_num_threads(config.threads)
    try:
        return uvloop.run(run(config, policy))
    except AuthError as exc:
        print(f"error: cannot authenticate to the services: {exc}", file=sys.stderr)
        return 1
    except (ConnectionError, OSError) as exc:
        print(f"error: cannot reach the services ({config.draft}, {config.target}): {exc}", file=sys.stderr)
        return 1
