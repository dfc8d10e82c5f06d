"""Routers: which target replica a newly admitted request is bound to (for its whole life).

A router looks only at the replicas' ledgers as the scheduler holds them during one plan (the
blocks and request slots already promised in this iteration included) and never does I/O. A
replica that is down, full (KV blocks) or at `max_running` is never picked; `None` means no
replica can take the request now.

- `round-robin`: the next replica after the last one picked, skipping those that cannot take it;
- `least-loaded`: the replica with the smallest share of its KV pool reserved, then the fewest
  requests, then the lowest index.
- `slo`: with `--admission slo`, SLOs-Serve's routing: the replicas' planners are asked in turn
  (admission/slo.py); with FIFO admission it is round-robin.

Every router has prefix affinity (`route`): a request whose prompt a replica's prefix cache holds more
of (by at least a block, as the gateway's mirror of the caches says: engine/prefix.py) goes there instead
of to the router's pick when loads allow, i.e. that replica can take it and runs at most
`AFFINITY_RUNNING_SLACK` more requests and `AFFINITY_KV_SLACK` more of its KV pool reserved than the
pick. So a conversation comes back to the replica that holds its history, and a shared system prompt's
requests gather where it is cached, until that replica is loaded enough for the balance to matter more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

AFFINITY_RUNNING_SLACK = 2  # prefix affinity: at most this many more requests than the router's pick
AFFINITY_KV_SLACK = 0.25  # and at most this much more of its KV pool reserved


@dataclass(slots=True)
class Ledger:
    """One replica's capacity as the scheduler sees it while planning."""

    up: bool
    total_blocks: int
    reserved_blocks: int
    running: int

    def fits(self, kv_blocks: int, max_running: int) -> bool:
        return self.up and self.running < max_running and self.reserved_blocks + kv_blocks <= self.total_blocks

    def take(self, kv_blocks: int) -> None:
        self.reserved_blocks += kv_blocks
        self.running += 1


class Router:
    name = ""

    def pick(self, ledgers: list[Ledger], kv_blocks: int, max_running: int) -> int | None:
        raise NotImplementedError

    def picked(self, index: int) -> None:
        """Called when the request the router placed was really admitted."""

    def route(self, ledgers: list[Ledger], kv_blocks: int, max_running: int,
              cached: Sequence[int] = ()) -> int | None:
        """`pick`, with prefix affinity: `cached[i]`, the prompt tokens replica i's prefix cache holds."""
        pick = self.pick(ledgers, kv_blocks, max_running)
        if pick is None or not cached:
            return pick
        best = max(range(min(len(cached), len(ledgers))), key=lambda i: cached[i], default=pick)
        if cached[best] <= (cached[pick] if pick < len(cached) else 0):  # (a whole number of blocks)
            return pick
        mine, there = ledgers[pick], ledgers[best]
        if (not there.fits(kv_blocks, max_running)
                or there.running > mine.running + AFFINITY_RUNNING_SLACK
                or there.reserved_blocks / max(there.total_blocks, 1)
                > mine.reserved_blocks / max(mine.total_blocks, 1) + AFFINITY_KV_SLACK):
            return pick
        return best


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self.next = 0  # the replica to try first

    def pick(self, ledgers: list[Ledger], kv_blocks: int, max_running: int) -> int | None:
        n = len(ledgers)
        for k in range(n):
            i = (self.next + k) % n
            if ledgers[i].fits(kv_blocks, max_running):
                return i
        return None

    def picked(self, index: int) -> None:
        self.next = index + 1


class LeastLoaded(Router):
    name = "least-loaded"

    def pick(self, ledgers: list[Ledger], kv_blocks: int, max_running: int) -> int | None:
        fits = [i for i, led in enumerate(ledgers) if led.fits(kv_blocks, max_running)]
        if not fits:
            return None
        return min(fits, key=lambda i: (ledgers[i].reserved_blocks / max(ledgers[i].total_blocks, 1),
                                        ledgers[i].running, i))


class SloAware(RoundRobin):
    """SLOs-Serve's routing (`--admission slo`): the first replica in turn, and a request its planner
    declines is offered to every other replica's planner (admission/slo.py). Under FIFO admission it
    is round-robin."""

    name = "slo"


ROUTERS: dict[str, Callable[[], Router]] = {"round-robin": RoundRobin, "least-loaded": LeastLoaded, "slo": SloAware}


def make_router(name: str) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of: {', '.join(ROUTERS)}")
    return ROUTERS[name]()
