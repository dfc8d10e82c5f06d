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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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
