"""`specserve up` owns its children, and a taken port is reported as exactly that.

`up` killed with SIGKILL (no chance to stop anything) must take the gateway, draft and target with
it within seconds, so that a new `up` on the same port starts. A port that is already taken stops
`up`, the gateway and both services at once with "port N is already in use", exit status 1.

The draft and target listen on Unix sockets in a private directory that `up` removes when it stops
(the services remove their own sockets, so even a killed `up` leaves no socket file);
`--tcp-services` puts them on loopback TCP ports instead, and both serve the API. Either way each
service serves Prometheus /metrics on a port of its own, printed as `metrics <name> <url>`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import openai
import pytest

from specserve.shared.host.launch import free_port
from specserve.shared.process.lifeline import DEATH_SIGNAL_VAR, PARENT_PID_VAR, child_environment, follow_parent
from specserve.shared.process.ports import PortInUse, check_port_free
from specserve.shared.wire.rpc import RpcServer
from tests.support import poll
from tests.support.procs import Up, service_pid

SECRET_VARS = ("SPECSERVE_SECRET", "SPECSERVE_SECRET_FILE")
PROFILE = Path(__file__).resolve().parent.parent / "bench/results/sweep-full/profile.json"  # no profiling at start


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")  # a zombie is dead, only not yet reaped


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[1]) == pid:
                out.add(int(entry))
    return out


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [item.decode(errors="replace").partition("=") for item in f.read().split(b"\0") if item]
    return {k: v for k, _, v in items}


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        return resp.status == 200


@pytest.mark.slow
def test_up_killed_outright_takes_its_children_along_and_a_new_up_gets_the_port():
    port = free_port()
    no_secret = {k: v for k, v in os.environ.items() if k not in SECRET_VARS}
    up = Up("--port", str(port), env=no_secret)  # up makes its own secret
    pids = {"target": service_pid("target", up.target), "draft": service_pid("draft", up.draft),
            "gateway": service_pid("gateway", up.url)}
    try:
        assert _children(up.proc.pid) == set(pids.values())
        assert _healthy(up.url)  # the gateway authenticated to both services with up's secret
        secrets_seen = {_environ(pid).get("SPECSERVE_SECRET") for pid in pids.values()}
        on_command_lines = [pid for pid in [up.proc.pid, *pids.values()]
                            if any(s and s.encode() in _cmdline(pid) for s in secrets_seen)]

        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait()
        poll.until(lambda: {name: pid for name, pid in pids.items() if _alive(pid)}, 15,
                   "up's services to follow it (still running: the last value)", ok=lambda alive: not alive,
                   interval_s=0.2)
        sockets = [Path(up.draft.removeprefix("unix:")), Path(up.target.removeprefix("unix:"))]
        assert not [p for p in sockets if p.exists()]  # each service removed its own socket as it stopped
        sockets[0].parent.rmdir()  # a killed `up` could not remove its (now empty) directory
    finally:
        for pid in pids.values():  # only the processes this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert len(secrets_seen) == 1 and len(secrets_seen.pop() or "") == 64  # one made-up secret, shared
    assert on_command_lines == []

    again = Up("--port", str(port))
    try:
        assert again.url.endswith(f":{port}") and _healthy(again.url)
    finally:
        assert again.interrupt() == 0


def _complete(url: str) -> str:
    """One greedy completion through the official client."""
    reply = openai.OpenAI(base_url=f"{url}/v1", api_key="x").completions.create(
        model="target", prompt="def main():", max_tokens=8, temperature=0)
    return reply.choices[0].text


@pytest.mark.slow
def test_up_puts_its_services_on_unix_sockets_in_a_private_directory_and_removes_it():
    up = Up("--policy", "chain:2", "--profile", str(PROFILE))
    try:
        assert up.draft.startswith("unix:") and up.target.startswith("unix:")
        sockets = [Path(up.draft.removeprefix("unix:")), Path(up.target.removeprefix("unix:"))]
        directory = sockets[0].parent
        assert sockets[1].parent == directory and all(stat.S_ISSOCK(p.stat().st_mode) for p in sockets)
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and directory.stat().st_uid == os.getuid()
        text = _complete(up.url)  # the gateway drafts and verifies through both sockets
        assert text and _complete(up.url) == text
    finally:
        assert up.interrupt() == 0
    assert not directory.exists(), f"left behind: {list(directory.iterdir())}"


@pytest.mark.slow
def test_tcp_services_puts_them_on_loopback_ports():
    up = Up("--policy", "chain:2", "--profile", str(PROFILE), "--tcp-services")
    try:
        for address in (up.draft, up.target):
            host, _, port = address.rpartition(":")
            assert host == "127.0.0.1" and port.isdigit(), address
        assert _complete(up.url)
        assert set(up.metrics) == {"gateway", "draft", "target"} and up.metrics["gateway"] == f"{up.url}/metrics"
        for name in ("draft", "target"):  # each on a port of its own, none of them an RPC port
            assert up.metrics[name].startswith("http://127.0.0.1:") and up.metrics[name] not in (up.draft, up.target)
            with urllib.request.urlopen(up.metrics[name], timeout=10) as resp:
                assert f'specserve:service_calls_total{{service="{name}"}}' in resp.read().decode()
    finally:
        assert up.interrupt() == 0


# A parent that starts a draft from a worker thread, reports the draft's pid and address once that
# thread has exited, and waits to be killed (its sleep is the scenario: a parent that lives on).
_THREAD_PARENT = """
import threading, time
from specserve.shared.host.launch import ServiceProcess
started = []
worker = threading.Thread(target=lambda: started.append(ServiceProcess("draft", "--kv-blocks", "16")))
worker.start()
worker.join()
print(started[0].proc.pid, started[0].address, flush=True)
time.sleep(600)
"""


def _health_twice(address: str) -> str:
    """Two Health calls on a new connection: the service's name from the second reply."""
    from specserve.shared.wire.messages import Health, HealthReply
    from specserve.shared.wire.rpc import RpcClient

    async def main() -> str:
        client = await RpcClient.connect(address)
        try:
            for _ in range(2):
                reply, _ = await client.call(Health(), HealthReply)
            return reply.service
        finally:
            await client.close()

    return asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.slow
def test_a_child_started_from_a_worker_thread_outlives_the_thread_and_follows_the_parent_by_its_watchdog():
    """Linux's parent-death signal fires when the starting *thread* exits, so it must not be armed
    there; the watchdog alone then takes the child down when the parent process dies. The thread has
    exited before the parent reports the child; a child given the signal then would stop serving (it
    stops as on Ctrl-C: connections closed), so a connection opened afterwards that is answered twice
    shows it was not given the signal."""
    parent = subprocess.Popen([sys.executable, "-c", _THREAD_PARENT], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = None
    try:
        pid, address = parent.stdout.readline().split()
        child = int(pid)
        assert _health_twice(address) == "draft", "the child stopped serving after the thread that started it exited"
        assert _alive(child), "the child died with the thread that started it"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        poll.until(lambda: not _alive(child), 10, "the child to follow its parent", interval_s=0.1)
    finally:
        if parent.poll() is None:
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("command", [
    ["up"],
    ["gateway", "--draft", "127.0.0.1:9", "--target", "127.0.0.1:9"],  # the port is checked first
    ["target"],
    ["draft"],
], ids=lambda c: c[0])
def test_a_taken_port_is_reported_as_such(command, taken_port):
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", *command, "--port", str(taken_port),
                           "--threads", "1"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    assert f"error: port {taken_port} is already in use (another specserve?)" in proc.stderr, proc.stderr
    assert "cannot reach" not in proc.stderr and "Traceback" not in proc.stderr
    assert "ready" not in proc.stdout


def test_a_taken_metrics_port_is_reported_as_such(taken_port):
    """`up` checks its services' /metrics ports too, before it starts anything."""
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "up", "--port", "0", "--metrics-port",
                           str(taken_port), "--threads", "1"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    assert f"error: port {taken_port} is already in use (another specserve?)" in proc.stderr, proc.stderr
    assert "starting" not in proc.stderr and "ready" not in proc.stdout


def test_the_bind_itself_reports_a_taken_port(taken_port):
    """The check before loading can race with another process: the real bind says the same."""
    with pytest.raises(PortInUse, match=f"port {taken_port} is already in use"):
        check_port_free("127.0.0.1", taken_port)

    async def main():
        await RpcServer(lambda *_: None).start(f"127.0.0.1:{taken_port}")

    with pytest.raises(PortInUse, match=f"port {taken_port} is already in use"):
        asyncio.run(main())


def test_the_lifeline_is_armed_only_by_its_variable():
    assert follow_parent(environ={}) is None  # a service started by hand: nothing set up
    env = child_environment({"OTHER": "1", DEATH_SIGNAL_VAR: "1"})
    assert env[PARENT_PID_VAR] == str(os.getpid()) and env[DEATH_SIGNAL_VAR] == "1" and env["OTHER"] == "1"
    from_thread: list[dict[str, str]] = []
    worker = threading.Thread(target=lambda: from_thread.append(child_environment({DEATH_SIGNAL_VAR: "1"})))
    worker.start()
    worker.join()
    assert DEATH_SIGNAL_VAR not in from_thread[0]  # Linux would signal when that thread ends
    # A parent that is already gone when the child starts: it stops at once, and the variable is consumed.
    gone = {PARENT_PID_VAR: str(os.getppid() + 1_000_000)}
    with pytest.raises(SystemExit):
        follow_parent(environ=gone)
    assert PARENT_PID_VAR not in gone
