"""The tasks alive on a process's asyncio event loop, as a Prometheus gauge read at scrape time.

`LoopTasks` is a prometheus_client collector: each scrape counts `asyncio.all_tasks(loop)` and yields
one gauge sample with fixed labels. A request that ends but leaves a task behind (a watcher, a reader,
a timer never cancelled) shows as a count that stays above its idle value once the process is idle;
bench/soak.py reads these gauges after every fault. Counting costs one pass over the loop's task set,
only when /metrics is read.

The gateway renders its metrics on its event loop's thread, where the count is taken directly. The
draft and target services serve /metrics from a thread of their own (shared/host/service_metrics.py):
there `threadsafe=True` asks the loop for the count (`run_coroutine_threadsafe`), so the task set is
never read while the loop changes it; a loop that does not answer within `TIMEOUT_S` (a long call
running inline on it) gives no sample for that scrape.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterable

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

TIMEOUT_S = 2.0  # how long a scrape from another thread waits for the loop's answer


async def _count() -> int:
    return len(asyncio.all_tasks()) - 1  # not this counting task itself


class LoopTasks:
    """A collector of one gauge, `name`{labels} = the number of tasks of `loop` not yet done."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], loop: asyncio.AbstractEventLoop,
                 threadsafe: bool = False):
        self.name, self.doc, self.labels, self.loop, self.threadsafe = name, doc, labels, loop, threadsafe

    def count(self) -> int | None:
        """The loop's live tasks (None: the loop is closed, or did not answer in time)."""
        if self.loop.is_closed():
            return None
        if not self.threadsafe:
            return len(asyncio.all_tasks(self.loop))
        try:
            return asyncio.run_coroutine_threadsafe(_count(), self.loop).result(TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            return None

    def collect(self) -> Iterable[Metric]:
        n = self.count()
        if n is None:
            return
        family = GaugeMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), n)
        yield family


__all__ = ["LoopTasks"]
