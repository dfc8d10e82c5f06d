"""`specserve up` owns its children, and a taken port is reported as exactly that.

Here: the tests that start the whole stack; the others are in tests/unit/test_up_lifecycle.py and
tests/service/test_up_lifecycle.py.
"""

from __future__ import annotations

import os
import signal
import stat
import urllib.request
from pathlib import Path

import openai

from specserve.shared.host.launch import free_port
from tests.support import poll
from tests.support.pids import proc_alive, proc_stat
from tests.support.procs import Up, service_pid

SECRET_VARS = ("SPECSERVE_SECRET", "SPECSERVE_SECRET_FILE")
PROFILE = Path(__file__).resolve().parents[2] / "bench/results/sweep-full/profile.json"  # no profiling at start






def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
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
        poll.until(lambda: {name: pid for name, pid in pids.items() if proc_alive(pid)}, 15,
                   "up's services to follow it (still running: the last value)", ok=lambda alive: not alive,
                   interval_s=0.2)
        sockets = [Path(up.draft.removeprefix("unix:")), Path(up.target.removeprefix("unix:"))]
        assert not [p for p in sockets if p.exists()]  # each service removed its own socket as it stopped
        sockets[0].parent.rmdir()  # a killed `up` could not remove its (now empty) directory
    finally:
        for pid in pids.values():  # only the processes this test started
            if proc_alive(pid):
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
