"""compose.yaml's services as plain processes: the exact command and environment of each.

No container runtime can pull images on the machines the suite runs on, so the test suite runs what
each compose service would run inside its container, on this machine:

- the command: the image's entrypoint is `specserve` (`python -m specserve.cli` here), `python` is
  this interpreter;
- the environment: the service's `environment:` with compose's `${VAR:-default}` interpolation, and
  nothing of the test's own SPECSERVE_* / OTEL_* variables;
- named volumes: one temporary folder each; a variable whose value is inside a volume's mount point
  points into that folder instead;
- the network: each container has its own address, so each process gets its own loopback address
  (all of 127.0.0.0/8 is loopback on Linux) and its `SPECSERVE_<SERVICE>_HOST` says so (compose's
  0.0.0.0 would make two target replicas collide on one port here). The ports are compose's;
- DNS: compose's service names are resolved by the gateway's `--hosts-file` (SPECSERVE_GATEWAY_HOSTS_FILE),
  a file in /etc/hosts format that names every replica's address; editing it moves replicas;
- `depends_on` is honoured: `service_completed_successfully` waits for exit 0, `service_healthy`
  runs the service's own healthcheck command (with 127.0.0.1 replaced by that process's address).

Not run: prometheus, grafana, jaeger (images of other projects); OTEL_EXPORTER_OTLP_ENDPOINT is
dropped because no jaeger listens (test_dashboard.py runs the real Prometheus binary instead).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specserve.shared.process.lifeline import child_environment
from tests.support import poll

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
DROPPED = ("OTEL_EXPORTER_OTLP_ENDPOINT",)  # the jaeger service is not run here


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's `${NAME}` and `${NAME:-default}` (an unset or empty NAME takes the default)."""
    return _VAR.sub(lambda m: environ.get(m.group(1)) or (m.group(2) or ""), value)


def load(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())  # anchors and `<<` merge keys are YAML's own


@dataclass
class Proc:
    name: str
    host: str
    popen: subprocess.Popen
    output: deque[str] = field(default_factory=lambda: deque(maxlen=400))

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 30) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def log(self) -> str:
        return "".join(self.output)


class ComposeStack:
    """Runs services of compose.yaml as processes under `tmp`. `hosts[name]` lists the loopback
    addresses of each service name; a service started twice (replicas) gets one address each."""

    def __init__(self, tmp: Path, subnet: str, compose: dict | None = None):
        self.compose = compose or load()
        self.tmp, self.subnet = tmp, subnet  # subnet: "127.A.B" (a /24 of loopback addresses)
        self.hosts_file = tmp / "hosts"
        self.hosts: dict[str, list[str]] = {}
        self.procs: list[Proc] = []
        self._next = 1
        self.environ = {k: v for k, v in os.environ.items() if not k.startswith(("SPECSERVE_", "OTEL_"))}
        self.write_hosts()

    # ---- names and addresses ---------------------------------------------------------------------
    def new_address(self) -> str:
        address = f"{self.subnet}.{self._next}"
        self._next += 1
        return address

    def write_hosts(self) -> None:
        lines = [f"{a} {name}" for name, addresses in self.hosts.items() for a in addresses]
        self.hosts_file.write_text("# service names of compose.yaml -> this test's loopback addresses\n"
                                   + "".join(line + "\n" for line in lines))

    def set_hosts(self, name: str, addresses: list[str]) -> None:
        self.hosts[name] = list(addresses)
        self.write_hosts()

    # ---- one service ----------------------------------------------------------------------------
    def spec(self, name: str) -> dict:
        return self.compose["services"][name]

    def volume_map(self, name: str) -> dict[str, Path]:
        """Mount point in the container -> this test's folder for that named volume."""
        out = {}
        for v in self.spec(name).get("volumes", []):
            source, target = v.split(":")[:2]
            folder = self.tmp / "volumes" / source
            folder.mkdir(parents=True, exist_ok=True)
            out[target] = folder
        return out

    def command(self, name: str) -> list[str]:
        spec = self.spec(name)
        entrypoint = spec.get("entrypoint", ["specserve"])
        argv = [*entrypoint, *spec.get("command", [])]
        head = {"specserve": [sys.executable, "-m", "specserve.cli"], "python": [sys.executable]}
        return [*head.get(argv[0], [argv[0]]), *argv[1:]]

    def environment(self, name: str, host: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for key, value in (self.spec(name).get("environment") or {}).items():
            if key in DROPPED:
                continue
            value = interpolate(str(value), dict(os.environ))
            for target, folder in self.volume_map(name).items():
                if value == target or value.startswith(target + "/"):
                    value = str(folder) + value[len(target):]
            env[key] = value
        prefix = f"SPECSERVE_{name.upper()}_"
        if prefix + "HOST" in env:
            env[prefix + "HOST"] = host  # its container's own address
        if name == "gateway":
            env["SPECSERVE_GATEWAY_HOSTS_FILE"] = str(self.hosts_file)  # compose's DNS
        return env

    def start(self, name: str, host: str | None = None) -> Proc:
        host = host or self.new_address()
        env = child_environment({**self.environ, **self.environment(name, host), "SPECSERVE_LOG_LEVEL": "INFO"})
        popen = subprocess.Popen(self.command(name), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, cwd=self.tmp)
        proc = Proc(name, host, popen)
        assert popen.stdout is not None
        threading.Thread(target=lambda: proc.output.extend(popen.stdout or ()), daemon=True).start()
        self.procs.append(proc)
        return proc

    # ---- depends_on and healthchecks --------------------------------------------------------------
    def healthcheck(self, proc: Proc) -> bool:
        test = self.spec(proc.name)["healthcheck"]["test"]
        assert test[0] == "CMD", test
        argv = [sys.executable if a == "python" else a.replace("127.0.0.1", proc.host) for a in test[1:]]
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0

    def wait_healthy(self, proc: Proc, timeout_s: float = 300) -> None:
        """Run the service's healthcheck until it passes; a process that exits first ends the wait."""
        def healthy() -> bool:
            if self.healthcheck(proc):
                return True
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.log()[-3000:]}")
            return False

        poll.until(healthy, timeout_s, f"{proc.name} to be healthy", interval_s=0.5,
                   show=lambda _: f"not healthy; its output:\n{proc.log()[-3000:]}")

    def wait_done(self, proc: Proc, timeout_s: float = 60) -> None:
        code = proc.popen.wait(timeout_s)
        if code != 0:
            raise RuntimeError(f"{proc.name} exited {code}:\n{proc.log()[-3000:]}")

    def depends_on(self, name: str) -> dict[str, str]:
        deps = self.spec(name).get("depends_on") or {}
        if isinstance(deps, list):
            return {d: "service_started" for d in deps}
        return {d: c.get("condition", "service_started") for d, c in deps.items()}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def known_variables() -> set[str]:
    """Every SPECSERVE_* variable a gateway, draft or target reads (shared/process/settings.py), plus the secret's
    and the log level's."""
    import dataclasses

    from specserve.draft.config import DraftConfig
    from specserve.gateway.config import GatewayConfig
    from specserve.target.config import TargetConfig

    out = {"SPECSERVE_SECRET", "SPECSERVE_SECRET_FILE", "SPECSERVE_LOG_LEVEL"}
    for cls in (GatewayConfig, DraftConfig, TargetConfig):
        out |= {cls.env_prefix + f.name.upper() for f in dataclasses.fields(cls)}
    return out
