"""Target replicas found by name: one replica per address that a name resolves to.

`docker compose up --scale target=3` gives the service name `target` three addresses in the
compose network's DNS; a Kubernetes headless Service does the same for its pods. With
`--discover-targets`, each `--target host:port` is such a name: the gateway resolves it to all its
addresses (one replica per address, the port kept), again every `--discovery-interval-s`, and hands
the set to the pool (`ServicePool.set_addresses`), which adds new replicas and drains and drops the
ones that vanished at the start of an engine iteration (never in the middle of one).

`--hosts-file` names a file in /etc/hosts format (`ADDRESS NAME [ALIAS ...]`, `#` comments) that is
read before DNS at every lookup; a name on several lines has all of those addresses. It serves
machines without a DNS server for the names (the test suite runs two targets on 127.0.0.2 and
127.0.0.3 this way) and lets an operator move replicas by editing one file.

A lookup that fails or finds nothing leaves the replica set as it is: a DNS hiccup is not every
replica vanishing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("specserve.gateway")


def split_address(address: str) -> tuple[str, int]:
    """"host:port" (or "[v6]:port") -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_hosts(path: str) -> dict[str, list[str]]:
    """A hosts file: every name (and alias) -> its addresses, in file order."""
    names: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) < 2:
            continue
        for name in fields[1:]:
            addresses = names.setdefault(name.lower(), [])
            if fields[0] not in addresses:
                addresses.append(fields[0])
    return names


class Resolver:
    """Name -> every address: the hosts file first (re-read each time), then DNS (getaddrinfo)."""

    def __init__(self, hosts_file: str | None = None):
        self.hosts_file = hosts_file

    async def resolve(self, host: str, port: int) -> list[str]:
        if self.hosts_file is not None:
            found = read_hosts(self.hosts_file).get(host.lower())
            if found:
                return found
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        out: list[str] = []
        for *_, sockaddr in infos:
            if sockaddr[0] not in out:
                out.append(str(sockaddr[0]))
        return sorted(out)

    async def resolve_address(self, address: str) -> list[str]:
        """"name:port" -> ["a1:port", "a2:port", ...]; a unix: address is itself."""
        if address.startswith("unix:"):
            return [address]
        host, port = split_address(address)
        return [join_address(a, port) for a in await self.resolve(host, port)]

    async def first(self, address: str) -> str:
        """One address for a name found in the hosts file (the draft's); other names are left to the
        system resolver at every connect."""
        if self.hosts_file is None or address.startswith("unix:"):
            return address
        host, port = split_address(address)
        found = read_hosts(self.hosts_file).get(host.lower())
        return join_address(found[0], port) if found else address


class TargetDiscovery:
    """Resolves the target names now and then, and gives the pool the addresses it found."""

    def __init__(self, names: list[str], resolver: Resolver, interval_s: float):
        self.names, self.resolver, self.interval_s = names, resolver, interval_s

    async def addresses(self) -> list[str] | None:
        """Every address of every name, or None when a lookup failed or found nothing."""
        out: list[str] = []
        for name in self.names:
            try:
                found = await self.resolver.resolve_address(name)
            except (OSError, ValueError) as exc:
                log.warning("cannot resolve target %s (%s): keeping the replicas as they are", name, exc)
                return None
            if not found:
                log.warning("target %s resolves to no address: keeping the replicas as they are", name)
                return None
            out.extend(a for a in found if a not in out)
        return out

    async def run(self, update: Callable[[list[str]], None]) -> None:
        """Forever: every interval, hand the addresses found to `update` (ServicePool.set_addresses)."""
        while True:
            await asyncio.sleep(self.interval_s)
            found = await self.addresses()
            if found is not None:
                update(found)

    def start(self, update: Callable[[list[str]], None]) -> asyncio.Task[None]:
        return asyncio.create_task(self.run(update), name="target-discovery")


async def stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
