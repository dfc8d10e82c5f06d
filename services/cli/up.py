"""`specserve up`: target, draft and gateway as three processes, health-checked, stopped together.

The draft and target listen on Unix sockets in a private temporary directory (mode 0700), removed
when `up` exits (the services remove their own sockets, so a SIGKILLed `up` leaves it empty): on
one host a call costs less through them than through loopback TCP (docs/lab/call_cost.md).
`--tcp-services` gives them fixed free TCP ports instead. Either way the address is fixed, so that
a service that crashes is restarted on the same address and the gateway reconnects to it. The
gateway's HTTP API is TCP (`--host`, `--port`).

Ctrl-C (SIGINT to the process group) or SIGTERM stops all three: the gateway first, then the draft
and the target. The three die with `up` even when it is killed outright (SIGKILL): see
shared/process/lifeline.py.

The services accept only connections that prove the shared secret (shared/wire/auth.py): `up` makes a
random one when neither SPECSERVE_SECRET_FILE nor SPECSERVE_SECRET is set, and its children get it
through the environment. A gateway port that is taken is reported as such, before anything starts.

Every service serves Prometheus `/metrics`: the gateway on its HTTP port, the draft and each target
replica on a port of 127.0.0.1 of its own (`--metrics-port`: the draft on 9101, target replica i on
9102 + i, the ports compose.yaml gives them; 0 picks free ones; '' serves none), kept across
restarts. `up` prints one `metrics <name> <url>` line per service; deploy/prometheus/local.yml
scrapes the default ports, which fills the bundled Grafana dashboard (docs/deployment.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

from specserve.gateway.sched.policy import DEFAULT_POLICY, policy_help
from specserve.shared.host.launch import ServiceProcess, SocketDir, free_port
from specserve.shared.host.service_base import default_threads
from specserve.shared.process.ports import GATEWAY_PORT, check_port_free
from specserve.shared.process.settings import Settings, option
from specserve.shared.runtime.loader import ACTIVATIONS, DTYPE_CHOICES, DTYPE_HELP, KERNELS, WEIGHTS
from specserve.shared.runtime.model_store import DEFAULT_MODEL, DEMO, MODELS, NAMED, resolve_or_exit
from specserve.shared.wire.auth import ensure_secret

RESTART_AFTER_S = 2.0  # wait this long before restarting a crashed draft or target
SERVICE_HOST = "127.0.0.1"  # where the draft and target listen (TCP services, /metrics)


@dataclass(slots=True, kw_only=True)
class UpConfig(Settings):
    """Each field is a flag (`--draft-model`) and a variable (`SPECSERVE_DRAFT_MODEL`); see
    specserve.shared.process.settings. `gateway_args` takes everything after `--` and has no variable."""

    env_prefix = "SPECSERVE_"

    host: str = option("127.0.0.1", "the gateway's HTTP host")
    port: int = option(GATEWAY_PORT, "the gateway's HTTP port (0: any free)")
    policy: str = option(DEFAULT_POLICY, f"the speculation policy: {policy_help()}")
    targets: int = option(1, "target replicas to start (the gateway spreads requests over them)")
    model: str | None = option(None, "target model: a directory, or a named model (`specserve models list`; "
                               f"`{DEMO}`: the bundled demo pair, small and fast, for tests)",
                               default_text=f"{DEFAULT_MODEL} (installed on first use); {DEMO} under --simulate")
    draft_model: str | None = option(None, "draft model: a directory, a named model, `ngram` (no model: "
                                     "trees drafted from the request's own prompt and output, for any target) "
                                     "or `replay:FILE` (a benchmark's recorded outputs, services/draft/replay.py)",
                                     default_text="the target's own: the one `specserve models list` names for a "
                                     "named model, the bundled demo draft for `demo` or a directory")
    device: str = option("cpu", "cpu or cuda[:N], for both model services")
    dtype: str = option("auto", DTYPE_HELP + ", for both model services", choices=DTYPE_CHOICES)
    weights: str = option("auto", "which weights the target runs: "
                          + "; ".join(f"{k}: {v}" for k, v in WEIGHTS.items()), choices=list(WEIGHTS))
    draft_weights: str = option("auto", "which weights the draft model runs (as --weights; q8_0 makes a float32 "
                                "draft about 2.5x faster on CPU, docs/lab/cpu_pass.md)", choices=list(WEIGHTS))
    kernels: str = option("auto", "which pass runs them: " + "; ".join(f"{k}: {v}" for k, v in KERNELS.items()),
                          choices=list(KERNELS))
    activations: str = option("auto", "the compiled CPU pass's activations, for both model services: "
                              + "; ".join(f"{k}: {v}" for k, v in ACTIVATIONS.items()), choices=list(ACTIVATIONS))
    threads: int = option(default_factory=default_threads, help="torch threads of each model service",
                          default_text="half the cores")
    profile: str | None = option(None, "profile file (measured on first start if missing)",
                                 default_text="~/.cache/specserve/profile-<model>-<device>.json")
    log_level: str = option("WARNING", "log level of the three services")
    simulate: str | None = option(None, "simulated model services: no weights, passes modelled by this preset "
                                  "(cpu-demo, llama2-7b-a100, llama2-70b-4xa100, or a .toml file; docs/simulation.md)")
    restart: bool = option(True, "do not restart a draft or target service that exits", negate=True)
    metrics_port: int | None = option(9101, "the draft's Prometheus /metrics port, on " + SERVICE_HOST + "; "
                                      "target replica i gets this + 1 + i (the gateway's /metrics is on its "
                                      "--port). 0: free ports; '': no /metrics for the draft and targets")
    tcp_services: bool = option(False, "the gateway reaches the draft and target over loopback TCP ports instead "
                                "of Unix sockets in a private temporary directory")
    gateway_args: list[str] = option(default_factory=list, remainder=True,
                                     help="after --: more gateway flags (e.g. -- --budget 32 --slo-class gold=20)")


def add_flags(parser: argparse.ArgumentParser) -> None:
    UpConfig.add_flags(parser)


def default_draft(model: str) -> str:
    """The draft `up` pairs a target with when --draft-model is not given: a named model's own (the n-gram
    draft, or a directory under models/), else the bundled demo draft."""
    from specserve.draft.ngram import NGRAM

    if model not in NAMED:
        return str(MODELS / "draft")
    draft = NAMED[model].draft
    return draft if draft == NGRAM else str(MODELS / draft)


def _shape(model: str) -> tuple[int, int] | None:
    """(vocabulary size, hidden size) of a model directory; None where its config cannot be read."""
    from specserve.shared.runtime.model_config import ModelConfig, ModelLoadError

    try:
        cfg = ModelConfig.from_dir(model)
    except (ModelLoadError, ValueError, FileNotFoundError):
        return None
    return cfg.vocab_size, cfg.hidden_size


def _same_vocabulary(model: str, draft_model: str) -> bool:
    """Speculation needs a draft with the target's tokenizer; say so in one line when the vocabularies differ."""
    from specserve.draft.eagle_head import is_eagle_dir, target_of
    from specserve.draft.ngram import NGRAM
    from specserve.draft.replay import is_replay

    if draft_model == NGRAM or is_replay(draft_model):
        return True  # it drafts the target's own token ids
    if is_eagle_dir(draft_model):  # a head reads its own target's features: the same shape of model is needed
        draft_model = resolve_or_exit(target_of(draft_model))
        if _shape(model) != _shape(draft_model):
            print(f"error: the EAGLE head was trained on {draft_model}, whose vocabulary and width differ from "
                  f"{model}'s; pass --draft-model, or --policy none", file=sys.stderr)
            return False
        return True
    target_shape, draft_shape = _shape(model), _shape(draft_model)
    if target_shape is None or draft_shape is None:
        return True  # a bad directory is reported by the service that loads it
    target, draft = target_shape[0], draft_shape[0]
    if target != draft:
        print(f"error: the draft model's vocabulary ({draft} tokens, {draft_model}) differs from the target's "
              f"({target}, {model}): speculation needs a draft with the target's tokenizer; pass --draft-model, "
              "or --policy none to serve without speculation", file=sys.stderr)
    return target == draft


def metrics_ports(config: UpConfig, names: list[str]) -> dict[str, int]:
    """The /metrics port of each service in `names` (the draft, then the target replicas): --metrics-port
    and the ports after it, free ports for 0, none when unset. A fixed port out of range or equal to the
    gateway's is a ValueError; one that is taken is PortInUse, before anything starts."""
    base = config.metrics_port
    if base is None:
        return {}
    if base == 0:
        return {name: free_port(SERVICE_HOST) for name in names}
    ports = {name: base + i for i, name in enumerate(names)}
    if base < 0 or base + len(names) - 1 > 65535:
        raise ValueError(f"--metrics-port {base}: the ports {base}-{base + len(names) - 1} are not all valid")
    if config.port in ports.values():
        raise ValueError(f"--metrics-port {base}: the services' /metrics ports {base}-{base + len(names) - 1} "
                         f"include the gateway's --port {config.port}")
    for port in ports.values():
        check_port_free(SERVICE_HOST, port)
    return ports


def main(args: argparse.Namespace) -> int:
    config = UpConfig.from_args(args)
    check_port_free(config.host, config.port)  # PortInUse: one line, exit 1, before any model loads
    targets = ["target"] if config.targets == 1 else [f"target-{i}" for i in range(config.targets)]
    try:
        metrics = metrics_ports(config, ["draft", *targets])  # PortInUse too
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sim = _prepare(config)
    if sim is None:
        return 2
    ensure_secret()  # the services' shared secret, for the children's environment
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    stack = _Stack(config, targets, metrics, sim)
    try:
        return stack.run(stopping)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


def _prepare(config: UpConfig) -> list[str] | None:
    """Named models (`--model smollm2-135m-instruct`) made their directories, installed once, here, so that
    the services and the gateway are all given the same directory; the draft checked against the target;
    the services' `--simulate` arguments (none without a preset). None: an error was printed."""
    model = config.model or (DEMO if config.simulate else DEFAULT_MODEL)
    draft = config.draft_model or default_draft(model)
    config.model, config.draft_model = resolve_or_exit(model), resolve_or_exit(draft)
    if config.simulate is None and config.policy != "none" and not _same_vocabulary(config.model, config.draft_model):
        return None
    if config.simulate is None:
        return []
    from specserve.shared.simulate.preset import PresetError, load_preset

    try:
        preset = load_preset(config.simulate)
    except PresetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    return ["--simulate", preset.spec]  # the file, with any time_scale override (the profile is keyed by both)


class _Stack:
    """The target replicas, the draft and the gateway as child processes: started in that order, the model
    services restarted when they exit (with `--restart`), all stopped together."""

    def __init__(self, config: UpConfig, targets: list[str], metrics: dict[str, int], sim: list[str]):
        self.config, self.targets, self.metrics = config, targets, metrics
        self.sockets = None if config.tcp_services else SocketDir()
        self.procs: dict[str, ServiceProcess] = {}
        self.specs: dict[str, list[str]] = {}
        self.sim = sim

    def listen(self, name: str) -> list[str]:
        """A service's addresses, the same on every (re)start."""
        rpc = (["--port", str(free_port(SERVICE_HOST))] if self.sockets is None
               else ["--unix-socket", self.sockets.socket(name)])
        return [*rpc, *(["--metrics-port", str(self.metrics[name])] if name in self.metrics else [])]

    def start(self, name: str) -> ServiceProcess:
        print(f"starting {name} ...", file=sys.stderr, flush=True)
        kind, *rest = self.specs[name]
        proc = ServiceProcess(kind, *rest, threads=self.config.threads, log_level=self.config.log_level,
                              inherit_stderr=True)
        print(f"ready {name} {proc.address}", flush=True)
        if name in self.metrics or name == "gateway":  # a service's server is up once it is ready
            url = f"http://{SERVICE_HOST}:{self.metrics[name]}" if name in self.metrics else proc.address
            print(f"metrics {name} {url}/metrics", flush=True)
        self.procs[name] = proc
        return proc

    def run(self, stopping: threading.Event) -> int:
        """Start everything, say where it serves, then watch it until `stopping` (0) or the gateway exits (1)."""
        config, procs = self.config, self.procs
        assert config.model is not None and config.draft_model is not None  # (_prepare resolved both)
        common = ["--device", config.device, "--dtype", config.dtype, "--kernels", config.kernels,
                  "--activations", config.activations, "--host", SERVICE_HOST]
        for name in self.targets:
            self.specs[name] = ["target", "--model", config.model, "--weights", config.weights, *common, *self.sim,
                                *self.listen(name)]
        self.specs["draft"] = ["draft", "--model", config.draft_model, "--weights", config.draft_weights, *common,
                               *self.sim, *self.listen("draft")]
        for name in [*self.targets, "draft"]:
            self.start(name)
        extra = [a for a in config.gateway_args if a != "--"]
        self.specs["gateway"] = ["gateway", "--draft", procs["draft"].address,
                                 *[arg for t in self.targets for arg in ("--target", procs[t].address)],
                                 "--model", config.model, "--device", config.device, "--policy", config.policy,
                                 "--host", config.host, "--port", str(config.port),
                                 *(["--profile", config.profile] if config.profile else []), *extra]
        url = self.start("gateway").address
        _wait_healthy(url)
        simulated = f"; SIMULATED, preset {config.simulate}" if self.sim else ""
        print(f"specserve is up: {url}/v1 (policy {config.policy}, {config.targets} target replica"
              f"{'s' if config.targets > 1 else ''}{simulated}; Ctrl-C stops them all)", flush=True)
        while not stopping.wait(0.5):
            for name in [*self.targets, "draft"]:
                if not procs[name].alive() and config.restart:
                    print(f"the {name} service exited ({procs[name].proc.returncode}); restarting it",
                          file=sys.stderr, flush=True)
                    time.sleep(RESTART_AFTER_S)
                    self.start(name)
            if not procs["gateway"].alive():
                print(f"the gateway exited ({procs['gateway'].proc.returncode}); stopping", file=sys.stderr)
                return 1
        return 0

    def stop(self) -> None:
        for name in ["gateway", "draft", *self.targets]:
            if name in self.procs:
                self.procs[name].stop()
        if self.sockets is not None:
            self.sockets.cleanup()
        print("specserve stopped", file=sys.stderr, flush=True)


def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway at {url} did not become healthy in {timeout_s:.0f} s")
        time.sleep(0.2)
