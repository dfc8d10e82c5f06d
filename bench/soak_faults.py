"""The soak's faults, each run against the live stack while the load goes on.

- `kill-draft`: SIGKILL of the draft service (`specserve up` starts it again);
- `kill-target`: SIGKILL of one target replica, the last (up starts it again);
- `kill-frontend`: SIGKILL of one front-end process (the engine process starts it again);
- `slow-client`: a streaming client that stops reading (a small receive window, nothing read): the
  gateway must cut it once its buffers stay full for `--stream-stall-s`, and count it `client_too_slow`
  (waited for up to SLOW_CLIENT_WAIT_S: the stream must fill those buffers first);
- `burst`: `n` requests of the mix at once, beside the steady load;
- `disconnect`: a client that closes its connection after its first streamed tokens: the engine must
  abort its request.

Each returns its record: name, kind, start time `t` (s from the run's start), what it touched, and how
long the stack took to be whole again (every role present, /health ready on every replica and the
draft). Waits are polls of what the stack reports, bounded by the grace period, never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import psutil
from soak_load import Load
from soak_probe import Probe, samples

POLL_S = 0.2
SLOW_CLIENT_WAIT_S = 600.0  # the stalled stream must first fill the gateway's buffers: minutes on a slow CPU


class Soak(Protocol):
    probe: Probe
    load: Load
    grace_s: float
    roles: set[str]  # every role the whole stack has

    def now(self) -> float: ...


async def until(probe: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool], timeout_s: float) -> tuple[bool, Any]:
    """Poll `probe()` every POLL_S until `ok(value)`; (whether it held, the last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if ok(value) or time.monotonic() >= deadline:
            return ok(value), value
        await asyncio.sleep(POLL_S)


def whole(health: dict | None) -> bool:
    """/health: every target replica and the draft ready."""
    return bool(health) and all(r["up"] for r in health["replicas"]) and health.get("draft") is not False


async def recovered(soak: Soak, role: str | None = None, old_pid: int | None = None) -> float | None:
    """Seconds until every role has a live process (`role` under a pid other than `old_pid`), every front
    end answers (its tasks gauge on /metrics) and /health says whole; None if not within the grace period."""
    t0 = time.monotonic()

    async def state() -> tuple[dict, dict | None, set[int]]:
        procs = soak.probe.processes()
        frontends = {p.pid for r, p in procs.items() if r.startswith("frontend-")}
        answered = set((await soak.probe.gateway_state(frontends))["frontend_tasks"])
        return procs, await soak.probe.health(), frontends - answered

    def ok(value: tuple[dict, dict | None, set[int]]) -> bool:
        procs, health, silent = value
        return (soak.roles <= set(procs) and (role is None or procs[role].pid != old_pid) and whole(health)
                and not silent)

    held, _ = await until(state, ok, soak.grace_s)
    return time.monotonic() - t0 if held else None


async def _kill(soak: Soak, role: str, kind: str) -> dict[str, Any]:
    proc = soak.probe.processes()[role]
    t = soak.now()
    os.kill(proc.pid, signal.SIGKILL)

    async def dead() -> bool:
        try:
            return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    await until(dead, bool, soak.grace_s)
    return {"name": kind, "kind": kind, "role": role, "t": t, "pid": proc.pid,
            "recovery_s": await recovered(soak, role, proc.pid)}


async def kill_draft(soak: Soak) -> dict[str, Any]:
    return await _kill(soak, "draft", "kill-draft")


async def kill_target(soak: Soak) -> dict[str, Any]:
    role = max(r for r in soak.roles if r.startswith("target"))
    return await _kill(soak, role, "kill-target")


async def kill_frontend(soak: Soak) -> dict[str, Any]:
    return await _kill(soak, "frontend-0", "kill-frontend")


async def counter(soak: Soak, name: str, label: tuple[str, str]) -> float:
    """The engine's counter `name` with the label `label` (through a front end); -1 when unreadable."""
    text = await soak.probe.text(f"{soak.probe.url}/metrics")
    values = [v for n, labels, v in samples(text or "") if n == name and labels.get(label[0]) == label[1]]
    return values[0] if values else -1.0


async def slow_client(soak: Soak, max_tokens: int, prompt: str = "Count slowly:") -> dict[str, Any]:
    """A stream whose client reads nothing: cut, and counted, within stall + grace."""
    name, label = "specserve:request_errors_total", ("code", "client_too_slow")
    before = await counter(soak, name, label)
    host, port = soak.probe.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": soak.load.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True, "service_tier": "flex"}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: a small window
    t = soak.now()
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        await asyncio.get_running_loop().sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                                      % len(body) + body)
        cut, _ = await until(lambda: counter(soak, name, label), lambda v: v > before,
                             max(soak.grace_s, SLOW_CLIENT_WAIT_S))
    finally:
        sock.close()
    return {"name": "slow-client", "kind": "slow-client", "t": t, "max_tokens": max_tokens, "cut": cut,
            "cut_after_s": soak.now() - t, "recovery_s": await recovered(soak)}


async def burst(soak: Soak, n: int) -> dict[str, Any]:
    t = soak.now()
    tasks = soak.load.burst(n)
    await asyncio.gather(*tasks, return_exceptions=True)
    first = len(soak.load.sent) - n  # (burst() appends its n at once)
    records = [s.record for s in soak.load.sent[first:first + n]]
    return {"name": "burst", "kind": "burst", "t": t, "requests": n, "completed": sum(r.ok for r in records),
            "refused_503": sum(r.status == 503 for r in records), "took_s": soak.now() - t,
            "recovery_s": await recovered(soak)}


async def disconnect(soak: Soak, max_tokens: int = 400) -> dict[str, Any]:
    """A stream closed by its client after its first tokens: the engine aborts it."""
    name, label = "vllm:request_success_total", ("finished_reason", "abort")
    before = await counter(soak, name, label)
    body = {"model": soak.load.model, "prompt": "Tell me a long story.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "service_tier": "flex"}
    t = soak.now()
    got = b""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        resp = await session.post(f"{soak.probe.url}/v1/completions", json=body)
        async for data in resp.content.iter_any():
            got += data
            if got.count(b"data: ") >= 2:
                break
        resp.close()  # the connection closed mid-stream
    aborted, _ = await until(lambda: counter(soak, name, label), lambda v: v > before, soak.grace_s)
    return {"name": "disconnect", "kind": "disconnect", "t": t, "status": resp.status, "read_bytes": len(got),
            "aborted": aborted, "recovery_s": await recovered(soak)}


__all__ = ["burst", "disconnect", "kill_draft", "kill_frontend", "kill_target", "recovered", "slow_client", "until"]
