"""Start specserve processes as children and wait until they listen: the one launcher.

A service prints one line, "ready <name> <address>", once its socket is open (port 0 picks a free
port, and the line carries the real one). `ServiceProcess` starts one and blocks until that line
(tests, benchmarks and `specserve up` use it); `start_async` does the same inside an event loop (the
gateway's front ends, frontend/procs.py). Both run `python -m specserve.cli KIND ...` (`cli_command`)
in `child_env()`, and give a child `READY_TIMEOUT_S` to be ready.

Services on the same host as their gateway can listen on Unix sockets instead of TCP ports (cheaper
per call, and no port to find): `SocketDir` is a private directory for them (mode 0700, removed
with its sockets by `cleanup()`), and `ServiceProcess(..., unix=True)` puts a draft or target on a
socket in a directory of its own, removed by `stop()`.

A child started here shares this process's secret (shared/wire/auth.py; one is made up and put into
os.environ if none is set, so that this process's own clients find it too) and dies with this
process, even on SIGKILL (shared/process/lifeline.py). Both travel in the environment, never on the
command line.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

from specserve.shared.process.lifeline import child_environment
from specserve.shared.wire.auth import ensure_secret

READY_TIMEOUT_S = 180.0


def cli_command(kind: str, *args: str) -> list[str]:
    """The command line of a specserve child: `python -m specserve.cli KIND ARGS...`."""
    return [sys.executable, "-m", "specserve.cli", kind, *args]


def child_env(**extra: str) -> dict[str, str]:
    """A child's environment: this one, the services' shared secret (made up if none is set, and put into
    os.environ so that this process's own clients find it too), the lifeline, and `extra`."""
    ensure_secret()
    return child_environment(dict(os.environ, **extra))


async def start_async(cmd: list[str], what: str) -> asyncio.subprocess.Process:
    """Start `cmd` (stdout piped, stderr inherited) and wait up to READY_TIMEOUT_S for its ready line;
    RuntimeError naming `what` when it exits or stays silent. Its later stdout is drained."""
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, env=child_env())
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)).decode()
    except TimeoutError:
        line = ""
    if not line.startswith("ready"):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise RuntimeError(f"{what} did not start (exit {proc.returncode}; its log is above)")
    asyncio.create_task(_drain(proc.stdout))
    return proc


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for services that must keep their port across restarts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


# Linux's limit on a Unix socket path is 108 bytes (sun_path), the terminating NUL included.
MAX_SOCKET_PATH = 107


class SocketDir:
    """A private directory (mode 0700, under TMPDIR) for the Unix sockets of services on this host."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="specserve-")

    def socket(self, name: str) -> str:
        """The path of `name`'s socket; a path over Linux's limit is a RuntimeError naming the cure."""
        path = os.path.join(self.path, f"{name}.sock")
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise RuntimeError(f"the Unix socket path {path!r} is longer than {MAX_SOCKET_PATH} bytes: set TMPDIR "
                               "to a shorter directory, or use TCP ports (--tcp-services)")
        return path

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class ServiceProcess:
    def __init__(self, kind: str, *args: str, threads: int = 1, log_level: str = "WARNING",
                 inherit_stderr: bool = False, unix: bool = False):
        """unix: a draft or target listens on a Unix socket in a private directory of its own (removed
        by stop()) instead of a TCP port; its address is then `unix:/path`."""
        self.socket_dir = SocketDir() if unix else None
        if self.socket_dir is not None:
            args = (*args, "--unix-socket", self.socket_dir.socket(kind))
        cmd = cli_command(kind, "--port", "0", "--threads", str(threads), *args)
        env = child_env(SPECSERVE_LOG_LEVEL=log_level)
        self.secret = ensure_secret()  # the services' shared secret, inherited through os.environ
        self.kind, self.args, self.threads = kind, args, threads
        # stdout carries only the ready line; stderr (logs) goes to the terminal or into a bounded buffer.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None if inherit_stderr else subprocess.PIPE,
                                     text=True, env=env)
        self.stderr: collections.deque[str] = collections.deque(maxlen=2000)
        stdout, stderr = self.proc.stdout, self.proc.stderr
        assert stdout is not None
        if stderr is not None:
            threading.Thread(target=lambda: self.stderr.extend(stderr), daemon=True).start()
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(READY_TIMEOUT_S)
        if not ready or not ready[0].startswith("ready"):
            if ready:  # its stdout ended: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
            running = self.proc.poll() is None
            self.stop()
            why = (f"was not ready within {READY_TIMEOUT_S:.0f} s (a loaded machine, or a long first build)" if running
                   else f"exited with status {self.proc.returncode}")
            raise RuntimeError(f"the {kind} service {why}; the last lines of its log:\n"
                               f"{''.join(self.stderr)[-2000:]}")
        self.address = ready[0].split()[-1]
        threading.Thread(target=lambda: collections.deque(stdout, maxlen=0), daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 20 s; returns the exit status. Removes its socket directory."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.socket_dir is not None:
            self.socket_dir.cleanup()
        return self.proc.returncode
