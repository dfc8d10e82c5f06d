"""The services the gateway drives: N target replicas and one draft, each with its own connection,
health, reconnect and the releases it is owed.

- `TargetReplica`: one target service. Its client, its KV ledger (pool size, blocks reserved by the
  requests bound to it, blocks free after its last call: evictable prefix-cache blocks count as free),
  its own `PassCost`, the requests bound to it for their whole life, the releases it is owed, and the
  mirror of its prefix cache (prefix.py).
- `DraftService`: the one draft service that serves every replica (request ids are unique across
  replicas). Its client, whether its weights are offloaded, and the releases it is owed.

A service is *up* while it has a connection. The executor marks one down after a transport
failure (connection lost, deadline exceeded); `reconnect` tries again at most once per
`RECONNECT_INTERVAL_S`. A service is *ready* (what `/health` reports) only while it is up and its
connection is still open now: a service that was killed has its connection closed by its kernel, so
it stops being ready at once, before any call or ping marks it down, and it is ready again only
after a reconnect has connected and finished the handshake and the state exchange. `readiness()`
says which, with the seconds since the last call the service answered. A (re)connected service is
asked for its state (`Stats`): a restarted one starts empty, and whatever one holds that the gateway
does not (a gateway restart, a call that timed out after it ran) is released. Releases owed to a
service survive its outage and are sent once it is back (a restarted service answers them as
unknown, which is harmless).

The replica set can change while serving (`discovery.py`: a DNS name re-resolved). The pool takes
the new address set with `set_addresses` and applies it in `reconnect`, which the engine calls at
the start of an iteration: a new address becomes a new replica (down until it connects, then it
takes new requests); a replica whose address vanished is *retired*: it takes no new request, serves
the ones bound to it to their end, gets the releases it is owed, and is then disconnected and
dropped. A retired replica that is down is dropped at once (its requests end with an error, as for
any replica that goes down). Replicas keep their index for the life of the gateway (requests and
iteration records name them by index), so a dropped replica stays in the list, down, and an address
that comes back reuses its entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from specserve.gateway.backends.prefix import PrefixMirror
from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.plan import DraftView, ReplicaView
from specserve.shared.wire.service_client import DraftClient, TargetClient

log = logging.getLogger("specserve.gateway")
RECONNECT_INTERVAL_S = 1.0
CONNECT_TIMEOUT_S = 5.0


class _Service:
    def __init__(self, address: str):
        self.address = address
        self.owed_releases: set[str] = set()  # request ids whose state this service must drop
        self._last_attempt = -math.inf
        self.last_ok = -math.inf  # time.monotonic() of the last call it answered (connect included)
        self.client: TargetClient | DraftClient | None = None

    @property
    def up(self) -> bool:
        return self.client is not None

    @property
    def ready(self) -> bool:
        """Up, and its connection open now (not merely at the last call or ping)."""
        return self.client is not None and self.client.rpc.alive

    def readiness(self, now: float) -> dict[str, object]:
        """`/health`'s view: "ready", "restarting" (the connection is gone: the gateway reconnects once
        the service answers again) or "down" (never connected); with the seconds since it last answered."""
        never = self.last_ok == -math.inf
        return {"readiness": "ready" if self.ready else ("down" if never else "restarting"),
                "since_last_ok_s": None if never else round(now - self.last_ok, 3)}

    async def mark_down(self) -> None:
        """Drop the connection (the executor saw a transport failure); `reconnect` tries again later."""
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    def due(self, now: float) -> bool:
        """Time for another reconnect attempt."""
        if now - self._last_attempt < RECONNECT_INTERVAL_S:
            return False
        self._last_attempt = now
        return True


class TargetReplica(_Service):
    def __init__(self, index: int, address: str, cost: PassCost):
        super().__init__(address)
        self.index = index
        self.cost = cost
        self.client: TargetClient | None = None
        self.total_blocks = 0  # its KV pool, blocks
        self.block_size = 16  # tokens per block
        self.free_blocks = 0  # free after its last call (what the service said)
        self.reserved_blocks = 0  # reserved by the requests bound to it
        # the requests bound to it (the engine's GenRequest), in admission order (engine/table.py binds them)
        self.requests: dict[str, Any] = {}
        self.retired = False  # its address vanished: no new requests; dropped once drained
        self.prefix = PrefixMirror()  # what its prefix cache holds, as the gateway can tell (prefix.py)
        self.device = ""  # where its model pass runs, as it said ("cpu", "cuda", "simulated")

    @property
    def state(self) -> str:
        if self.retired:
            return "draining" if self.up else "dropped"
        return "up" if self.up else "down"

    async def connect(self) -> None:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            client = await TargetClient.connect(self.address)
            try:
                stats = await client.stats()
            except BaseException:
                await client.close()
                raise
        self.client = client
        self.last_ok = time.monotonic()
        self.total_blocks, self.block_size, self.free_blocks = stats.total_blocks, stats.block_size, stats.free_blocks
        self.prefix.reset(stats.prefix_caching)  # a restarted replica's cache is empty
        self.device = stats.device
        # Whatever it holds that no request of ours is bound to (a gateway restarted, a call that timed
        # out after it ran) is released with the next owed releases.
        self.owed_releases.update(set(stats.request_ids) - self.requests.keys())

    def view(self) -> ReplicaView:
        """What the scheduler sees; it takes new requests only while its connection is open now (`ready`): a
        replica killed while idle has its connection closed by its kernel before any call or ping marks it
        down, and a request routed to it then would fail at its first pass."""
        return ReplicaView(self.index, self.ready and not self.retired, self.total_blocks, self.reserved_blocks,
                           len(self.requests), self.cost, self.held_blocks, self.block_size)

    @property
    def held_blocks(self) -> int:
        """KV blocks its requests hold after its last call (the target allocates them as tokens are written)."""
        return max(0, self.total_blocks - self.free_blocks) if self.up else 0


class DraftService(_Service):
    def __init__(self, address: str):
        super().__init__(address)
        self.client: DraftClient | None = None
        self.offloaded = False  # weights in host memory: root-only trees until reloaded
        self.reads_features = False  # it drafts from the target's features: the passes return them
        self.max_depth = self.max_width = 0  # the largest tree it accepts (its Health reply says)

    async def connect(self) -> None:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            client = await DraftClient.connect(self.address)
            try:
                health = await client.health()
                stats = await client.stats()
            except BaseException:
                await client.close()
                raise
        self.client = client
        self.last_ok = time.monotonic()
        self.offloaded = health.status == "offloaded"
        self.reads_features = health.reads_features
        self.max_depth, self.max_width = health.max_depth, health.max_width
        # Its state for any request is stale now (every request rebuilds its draft state after a
        # reconnect), so everything it holds is released with the next owed releases.
        self.owed_releases.update(stats.request_ids)

    def view(self) -> DraftView:
        return DraftView(self.up, self.offloaded)


class ServicePool:
    """The target replicas and the draft, and their reconnects."""

    def __init__(self, targets: list[TargetReplica], draft: DraftService | None,
                 new_cost: Callable[[], PassCost] | None = None):
        self.targets = targets
        self.draft = draft  # None when the policy never speculates
        self.new_cost = new_cost  # a new replica's cost model (needed for set_addresses)
        self._pending: list[str] | None = None  # an address set from discovery, applied in reconnect

    def set_addresses(self, addresses: list[str]) -> None:
        """The target replicas should be exactly these addresses (applied at the next `reconnect`)."""
        current = [t.address for t in self.targets if not t.retired]
        if addresses != current:
            self._pending = list(addresses)

    def _apply_addresses(self) -> None:
        addresses, self._pending = self._pending, None
        if addresses is None:
            return
        by_address = {t.address: t for t in self.targets}
        for address in addresses:
            t = by_address.get(address)
            if t is None:
                assert self.new_cost is not None, "a pool that is given addresses needs new_cost"
                self.targets.append(TargetReplica(len(self.targets), address, self.new_cost()))
                log.info("target replica %d added at %s", len(self.targets) - 1, address)
            elif t.retired:
                t.retired = False
                log.info("target replica %d at %s is back in the set", t.index, address)
        for t in self.targets:
            if t.address not in addresses and not t.retired:
                t.retired = True
                log.info("target replica %d at %s left the set: draining its %d requests", t.index, t.address,
                         len(t.requests))

    async def _drop_drained(self) -> None:
        for t in self.targets:
            if not t.retired:
                continue
            if not t.up:
                t.owed_releases.clear()  # gone: nobody to tell
            elif not t.requests and not t.owed_releases:
                log.info("target replica %d at %s drained and dropped", t.index, t.address)
                await t.mark_down()

    @property
    def any_target_up(self) -> bool:
        return any(t.up for t in self.targets)

    @property
    def block_size(self) -> int:
        return next((t.block_size for t in self.targets if t.total_blocks), 16)

    @property
    def largest_pool_blocks(self) -> int:
        """The largest KV pool of any replica seen so far (a request that needs more can never run)."""
        return max((t.total_blocks for t in self.targets), default=0)

    async def connect_all(self) -> None:
        """At start: every service must answer (the gateway does not start half connected)."""
        for t in self.targets:
            await t.connect()
        if self.draft is not None:
            await self.draft.connect()

    async def reconnect(self, errors: tuple[type[BaseException], ...]) -> list[str]:
        """Apply a new address set, drop drained replicas, then try the services that are down (each
        at most once per interval); returns what came back."""
        self._apply_addresses()
        await self._drop_drained()
        now = time.monotonic()
        back = []
        services: list[TargetReplica | DraftService] = [t for t in self.targets if not t.up and not t.retired]
        if self.draft is not None and not self.draft.up:
            services.append(self.draft)
        for s in services:
            if not s.due(now):
                continue
            try:
                await s.connect()
            except errors:
                continue
            name = f"target {s.index}" if isinstance(s, TargetReplica) else "draft"
            log.info("%s service reconnected at %s", name, s.address)
            back.append(name)
        return back

    @property
    def needs_reconnect(self) -> bool:
        return (self._pending is not None or any(t.up != (not t.retired) for t in self.targets)
                or (self.draft is not None and not self.draft.up))

    async def close(self) -> None:
        for s in [*self.targets, *([self.draft] if self.draft else [])]:
            await s.mark_down()
