"""`specserve up` owns its children, and a taken port is reported as exactly that.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_up_lifecycle.py and tests/stack/test_up_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import pytest

from specserve.shared.process.ports import PortInUse, check_port_free
from specserve.shared.wire.rpc import RpcServer
from tests.support import poll
from tests.support.pids import proc_alive

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
        assert proc_alive(child), "the child died with the thread that started it"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        poll.until(lambda: not proc_alive(child), 10, "the child to follow its parent", interval_s=0.1)
    finally:
        if parent.poll() is None:
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait()
        if child is not None and proc_alive(child):
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
