"""`LoopTasks` (shared/process/loop_tasks.py): the gauge of an event loop's live tasks, read on the loop's
own thread (the gateway renders /metrics there) and from another thread (a model service's /metrics
server), and gone from the exposition once its loop is closed."""

from __future__ import annotations

import asyncio
import threading

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from specserve.shared.process.loop_tasks import LoopTasks


def exposed(collector: LoopTasks) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


def test_counts_the_tasks_of_its_own_loop():
    async def main() -> tuple[int | None, int | None, str]:
        gauge = LoopTasks("specserve:asyncio_tasks", "Tasks.", {"model_name": "m"}, asyncio.get_running_loop())
        stop = asyncio.Event()
        tasks = [asyncio.create_task(stop.wait()) for _ in range(3)]
        await asyncio.sleep(0)
        during, text = gauge.count(), exposed(gauge)
        stop.set()
        await asyncio.gather(*tasks)
        return during, gauge.count(), text

    during, after, text = asyncio.run(main())
    assert (during, after) == (4, 1)  # the three and main()
    assert 'specserve:asyncio_tasks{model_name="m"} 4.0' in text


def test_counts_from_another_thread_and_stops_with_its_loop():
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), asyncio.Event()

    async def serve() -> None:
        waiters = [asyncio.create_task(stop.wait()) for _ in range(2)]
        ready.set()
        await asyncio.gather(*waiters)

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()))
    thread.start()
    assert ready.wait(10)
    gauge = LoopTasks("specserve:service_asyncio_tasks", "Tasks.", {"service": "draft"}, loop, threadsafe=True)
    try:
        assert gauge.count() == 3  # serve() and its two waiters; the count's own task is not counted
        assert 'specserve:service_asyncio_tasks{service="draft"} 3.0' in exposed(gauge)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
    loop.close()
    assert gauge.count() is None and "service_asyncio_tasks{" not in exposed(gauge)
