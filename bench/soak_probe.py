"""What the soak reads from a running `specserve up`: every process of its group by role, each one's
RSS, open descriptors, threads and event-loop tasks, and the KV blocks and requests every model service
holds beside the gateway's own view of what runs.

Memory: RSS, and its anonymous part (RSS less the file-backed and shared pages, /proc/PID/statm):
what a leak grows. The file-backed part (the mapped model weights, the libraries) comes and goes
with the page cache when other processes need memory, so it is recorded but not judged.

Roles: `up` itself, `gateway` (the engine process), `frontend-0`, `frontend-1` (its `--frontends`
processes), `draft`, `target-0`, `target-1` (or `target`). A process is found in up's process group
(up runs in a session of its own) by its command line: the kind after `specserve.cli`, and for a
model service the socket or port `up` printed for that name. A restarted process keeps its role under
a new pid; a restarted front end takes the slot of the one that died.

Tasks come from the gauges added for this: `specserve:asyncio_tasks` (the engine's loop, on the
gateway's /metrics), `specserve:frontend_asyncio_tasks{pid}` (each front end appends its own to the
/metrics it serves; new connections are made until every front end has answered once) and
`specserve:service_asyncio_tasks` (each model service's /metrics). KV: the services'
`specserve:service_kv_blocks_used` and `specserve:service_requests`.
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

FRONTEND_TRIES = 40  # /metrics reads, each on a new connection, to hear from every front end


def _argv_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None


class Probe:
    def __init__(self, pgid: int, addresses: dict[str, str], metrics: dict[str, str], gateway_url: str):
        """pgid: `up`'s process group; addresses and metrics: up's `ready` and `metrics` lines by name."""
        self.pgid, self.addresses, self.metrics, self.url = pgid, addresses, metrics, gateway_url
        self.frontend_slots: dict[int, int] = {}  # front-end pid -> slot
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30),
                                             connector=aiohttp.TCPConnector(force_close=True))

    async def close(self) -> None:
        await self.session.close()

    # ---- processes -------------------------------------------------------------------------------
    def _service_role(self, argv: list[str]) -> str | None:
        where = _argv_value(argv, "--unix-socket")
        for name, address in self.addresses.items():
            if name in ("gateway",):
                continue
            if where is not None and address == f"unix:{where}":
                return name
            port = _argv_value(argv, "--port")
            if where is None and port is not None and port != "0" and address.endswith(f":{port}"):
                return name
        return None

    def processes(self) -> dict[str, psutil.Process]:
        """Every live process of up's group by role."""
        found: dict[str, psutil.Process] = {}
        frontends: list[psutil.Process] = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if os.getpgid(p.pid) != self.pgid or p.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
            except (ProcessLookupError, PermissionError):
                continue
            argv = p.info["cmdline"] or []
            if "specserve.cli" not in argv:
                continue
            kind = argv[argv.index("specserve.cli") + 1] if argv.index("specserve.cli") + 1 < len(argv) else ""
            if kind == "up":
                found["up"] = p
            elif kind == "gateway":
                if "--frontend-of" in argv:
                    frontends.append(p)
                else:
                    found["gateway"] = p
            elif kind in ("target", "draft"):
                role = self._service_role(argv)
                if role is not None:
                    found[role] = p
        for p in sorted(frontends, key=lambda q: q.pid):
            found[f"frontend-{self._slot(p.pid, {q.pid for q in frontends})}"] = p
        return found

    def _slot(self, pid: int, alive: set[int]) -> int:
        if pid not in self.frontend_slots:
            taken = {s for q, s in self.frontend_slots.items() if q in alive}
            self.frontend_slots[pid] = next(i for i in range(len(alive) + 1) if i not in taken)
        return self.frontend_slots[pid]

    @staticmethod
    def stat(p: psutil.Process) -> dict[str, Any] | None:
        try:
            with p.oneshot():
                mem = p.memory_info()
                return {"pid": p.pid, "rss_mb": mem.rss / 2**20, "anon_mb": (mem.rss - mem.shared) / 2**20,
                        "fds": p.num_fds(), "threads": p.num_threads()}
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return None

    # ---- metrics -------------------------------------------------------------------------------
    async def text(self, url: str) -> str | None:
        try:
            async with self.session.get(url) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def gateway_state(self, frontends: set[int]) -> dict[str, Any]:
        """The engine's tasks, running, waiting and KV usage, and each front end's tasks (by pid)."""
        out: dict[str, Any] = {"frontend_tasks": {}}
        for _ in range(FRONTEND_TRIES):
            text = await self.text(f"{self.url}/metrics")
            if text is not None:
                for name, labels, value in samples(text):
                    if name == "specserve:frontend_asyncio_tasks":
                        out["frontend_tasks"][int(labels["pid"])] = value
                    elif name in GATEWAY_GAUGES:
                        out[GATEWAY_GAUGES[name]] = value
            if "engine_tasks" in out and frontends <= set(out["frontend_tasks"]):
                break
        return out

    async def service_state(self) -> dict[str, dict[str, float]]:
        """Each model service's KV blocks used and total, requests held and tasks, from its /metrics."""
        out: dict[str, dict[str, float]] = {}
        for name, url in self.metrics.items():
            if name == "gateway":
                continue
            text = await self.text(url)
            if text is None:
                continue
            out[name] = {SERVICE_GAUGES[n]: v for n, _, v in samples(text) if n in SERVICE_GAUGES}
        return out

    async def health(self) -> dict[str, Any] | None:
        try:
            async with self.session.get(f"{self.url}/health") as resp:
                body: dict[str, Any] = await resp.json()
                return body
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None

    async def snapshot(self, t: float) -> dict[str, Any]:
        """One reading of everything: per role its pid, RSS and anonymous RSS (MB), descriptors, threads and tasks; per
        model service its KV blocks and requests; the gateway's running, waiting and KV usage."""
        procs = {role: s for role, p in sorted(self.processes().items()) if (s := self.stat(p)) is not None}
        gateway = await self.gateway_state({s["pid"] for r, s in procs.items() if r.startswith("frontend-")})
        services = await self.service_state()
        for role, s in procs.items():
            if role == "gateway":
                s["tasks"] = gateway.get("engine_tasks")
            elif role.startswith("frontend-"):
                s["tasks"] = gateway["frontend_tasks"].get(s["pid"])
            elif role in services:
                s["tasks"] = services[role].get("tasks")
        kv = {name: {k: v for k, v in s.items() if k != "tasks"} for name, s in services.items()}
        return {"t": round(t, 3), "procs": procs, "kv": kv,
                "gateway": {k: gateway.get(k) for k in ("running", "waiting", "kv_usage")}}


GATEWAY_GAUGES = {"specserve:asyncio_tasks": "engine_tasks", "vllm:num_requests_running": "running",
                  "vllm:num_requests_waiting": "waiting", "vllm:kv_cache_usage_perc": "kv_usage"}
SERVICE_GAUGES = {"specserve:service_kv_blocks_used": "used", "specserve:service_kv_blocks_total": "total",
                  "specserve:service_requests": "requests", "specserve:service_asyncio_tasks": "tasks"}


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of a text exposition; [] for text that does not parse."""
    try:
        return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    except ValueError:
        return []


__all__ = ["Probe", "samples"]
