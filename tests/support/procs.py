"""Start `specserve up` (and extra gateways on its services) as real processes for tests; kill its
services and wait on what its /health reports (events, not sleeps)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable

import httpx

from specserve.shared.host.launch import ServiceProcess
from tests.support import poll


class Up:
    """`specserve up` in its own process group, as a terminal would run it; parses its ready lines and
    its `metrics <name> <url>` lines. Its services' /metrics are on free ports (`--metrics-port 0`), so
    that two can run at once; a test passes `--metrics-port` to choose. It serves the bundled demo pair
    (`--model demo`: small and fast) unless the test passes `--model`, or `demo=False` for up's own default."""

    def __init__(self, *args: str, timeout_s: float = 240, env: dict[str, str] | None = None, demo: bool = True):
        model = ["--model", "demo"] if demo and "--model" not in args and "--simulate" not in args else []
        cmd = [sys.executable, "-m", "specserve.cli", "up", "--port", "0", "--metrics-port", "0", "--threads", "1",
               *model, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env=env)
        self.stderr: deque[str] = deque(maxlen=500)
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.addresses: dict[str, str] = {}
        self.metrics: dict[str, str] = {}  # service name -> its /metrics URL
        self.lines: list[str] = []
        done = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("ready "):
                    _, name, address = line.split()
                    self.addresses[name] = address
                if line.startswith("metrics "):
                    _, name, url = line.split()
                    self.metrics[name] = url
                if line.startswith("specserve is up"):
                    done.set()
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(timeout_s) or "gateway" not in self.addresses:
            self.interrupt()
            raise RuntimeError(f"specserve up did not start: {''.join(self.lines)}{''.join(self.stderr)[-3000:]}")
        self.url = self.addresses["gateway"]

    @property
    def draft(self) -> str:
        return self.addresses["draft"]

    @property
    def target(self) -> str:
        return self.addresses["target"]

    def interrupt(self, timeout_s: float = 60) -> int:
        """Ctrl-C: SIGINT to the whole process group; returns up's exit status."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def gateway(up: Up, policy: str, *args: str) -> ServiceProcess:
    """Another gateway on `up`'s draft and target services, started the way `up` starts its own."""
    return ServiceProcess("gateway", "--draft", up.draft, "--target", up.target, "--policy", policy, *args)


def service_pid(kind: str, address: str) -> int:
    """The pid of the `specserve <kind>` process listening at address, `host:port` or `unix:/path`
    (found through /proc: the port or the socket path is on its command line)."""
    port = address.removeprefix("unix:") if address.startswith("unix:") else address.rsplit(":", 1)[1]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"specserve.cli" in argv and kind.encode() in argv and port.encode() in argv:
            return int(entry)
    raise LookupError(f"no {kind} process at {address}")


def health(url: str) -> dict:
    """The gateway's /health body (200 or 503)."""
    return httpx.get(f"{url}/health", timeout=30).json()


def wait_health(url: str, ok: Callable[[dict], bool], what: str, timeout_s: float = 180) -> dict:
    """Poll /health until `ok(body)`; the deadline only bounds a hang (a loaded machine is slow, not wrong)."""
    return poll.until(lambda: health(url), timeout_s, what, ok=ok, show=lambda body: f"/health: {body}")


async def await_health(url: str, ok: Callable[[dict], bool], until: asyncio.Future | None = None,
                       timeout_s: float = 180, what: str = "a state of /health") -> dict | None:
    """Inside a test's event loop: poll /health until `ok(body)` and return the body, or None if `until`
    finishes first (the load the test waits on ended before the state was seen)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        async def body() -> dict:
            return (await h.get("/health")).json()

        return await poll.until_async(body, timeout_s, what, ok=ok, unless=until, show=lambda b: f"/health: {b}")


def kill(kind: str, address: str) -> int:
    """SIGKILL the `specserve <kind>` service at address and return once it has died, sockets closed
    (the peers have their EOF by then); returns its pid."""
    pid = service_pid(kind, address)
    os.kill(pid, signal.SIGKILL)
    poll.until(lambda: _dead(pid), 60, f"{kind} {pid} to die of SIGKILL", interval_s=0.01)
    return pid


def _dead(pid: int) -> bool:
    """Gone, or a zombie whose every thread has finished exiting. Neither an empty file table (a dying
    task closes a socket's last reference after dropping its file table) nor a zombie leader (its other
    threads may still hold the files) is enough; a thread is listed in /proc/PID/task until its exit,
    socket releases included, is complete."""
    try:
        if len(os.listdir(f"/proc/{pid}/task")) > 1:
            return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True
