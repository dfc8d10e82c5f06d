"""The soak's load: an SLO mix of streamed requests at a Poisson rate that can be paused, plus bursts.

Requests come from `specserve bench`'s own parts (services/cli/loadgen/): the mix and its prompt sets
(`parse_mix`, `build_requests`), Poisson gaps (`gamma_arrivals`' draw), one streamed request timed
as `vllm bench serve` times it (`send`) into a `RequestRecord`. What this adds is what a run of hours
under faults needs: `pause()` / `resume()` (the soak stops sending while it checks that the stack is
back to idle after a fault, and `drain()` waits for what is in flight), `burst(n)` (n at once), and
for every request the front-end process that served it (the `X-Specserve-Frontend` header of its
stream, through an aiohttp trace hook), so that a killed front end owns exactly its own streams.

Every connection is closed after its request (`force_close`): idle keep-alive connections would hold
descriptors in the front ends, and each new connection is spread over them by SO_REUSEPORT.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from specserve.cli.loadgen.client import send
from specserve.cli.loadgen.records import RequestRecord
from specserve.cli.loadgen.workload import BenchRequest, Category, build_requests
from specserve.gateway.sched.slo_classes import ALIASES

FRONTEND_HEADER = "X-Specserve-Frontend"
_current: contextvars.ContextVar[int] = contextvars.ContextVar("soak_request_index")
BATCH = 512  # requests built at a time (build_requests keeps the mix's exact shares within a batch)


@dataclass
class Sent:
    """One request of the soak: its record, the front end that served it, and what sent it."""

    record: RequestRecord
    source: str  # "capacity", "load", "warmup-burst" or "burst"
    frontend: int | None = None  # pid from the stream's header (None: no front ends, or no response)
    done_s: float | None = None  # when the client saw it end, s from the run's start

    @property
    def end_s(self) -> float:
        return self.done_s if self.done_s is not None else float("inf")


@dataclass
class Load:
    url: str  # the gateway's base URL
    model: str
    categories: list[Category]
    classes: dict  # /v1/slo_classes' "classes"
    rate: float  # requests/s while running
    t0: float  # the run's perf_counter origin
    seed: int = 0
    timeout_s: float = 900.0
    ignore_eos: bool = True
    sent: list[Sent] = field(default_factory=list)
    _tasks: set[asyncio.Task[Sent]] = field(default_factory=set)
    _open: asyncio.Event = field(default_factory=asyncio.Event)  # set while sending
    _paused: asyncio.Event = field(default_factory=asyncio.Event)  # its opposite, to wait on
    _queue: list[BenchRequest] = field(default_factory=list)
    _batches: int = 0

    def __post_init__(self) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_end.append(self._headers)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                             connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                             trace_configs=[trace])
        self.rng = random.Random(self.seed)

    async def _headers(self, _session: object, _ctx: object, params: aiohttp.TraceRequestEndParams) -> None:
        index = _current.get(None)
        pid = params.response.headers.get(FRONTEND_HEADER)
        if index is not None and pid is not None:
            self.sent[index].frontend = int(pid)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def next_request(self) -> BenchRequest:
        if not self._queue:
            self._queue = build_requests(self.categories, BATCH, self.seed + self._batches)
            self._batches += 1
        return self._queue.pop(0)

    def start(self, req: BenchRequest, source: str) -> asyncio.Task[Sent]:
        """Send one request now: a task that returns its Sent once it ended (appended to `sent` at once)."""
        cls = self.classes[ALIASES.get(req.category, req.category)]
        index = len(self.sent)
        record = RequestRecord(index=index, category=req.category, workload=req.workload, prompt_id=req.prompt_id,
                               slo_tpot_ms=req.tpot_ms or cls["tpot_ms"], slo_ttft_ms=cls["ttft_ms"],
                               scheduled_s=self.now(), sent_s=self.now(), max_tokens=req.max_tokens)
        self.sent.append(Sent(record, source))

        async def one() -> Sent:
            _current.set(index)
            await send(self.session, f"{self.url}/v1/completions", req, record, self.model, self.ignore_eos, self.t0)
            self.sent[index].done_s = self.now()
            return self.sent[index]

        task = asyncio.create_task(one())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self, until: Callable[[], float]) -> None:
        """Poisson arrivals at `rate` until `until()` (run time, read again at every arrival: the soak
        moves its end when faults ran late), sending only while resumed; a pause restarts the gaps when
        it ends."""
        while self.now() < until():
            if not self._open.is_set():
                await self._open.wait()
                continue
            gap = self.rng.expovariate(self.rate)
            try:
                await asyncio.wait_for(self._paused.wait(), timeout=max(0.0, min(gap, until() - self.now())))
                continue  # paused meanwhile: this arrival is not sent
            except TimeoutError:
                pass
            if self.now() < until() and self._open.is_set():
                self.start(self.next_request(), "load")

    def resume(self) -> None:
        self._paused.clear()
        self._open.set()

    def pause(self) -> None:
        self._open.clear()
        self._paused.set()

    def in_flight(self) -> int:
        return len(self._tasks)

    async def drain(self) -> None:
        """Wait until every request sent so far has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def burst(self, n: int, source: str = "burst") -> list[asyncio.Task[Sent]]:
        """n requests of the mix at once."""
        return [self.start(self.next_request(), source) for _ in range(n)]

    async def close(self) -> None:
        await self.drain()
        await self.session.close()


__all__ = ["FRONTEND_HEADER", "Load", "Sent"]
