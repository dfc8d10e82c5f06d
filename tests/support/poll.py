"""The suite's one poll-until, for states a test can only look at, not wait on (what a process's
/health or /metrics says, a file, another process's output); a test that has an event waits on it.

`until(probe, timeout_s, what)` calls `probe()` every `interval_s` until `ok(value)` holds and returns
that value; `until_async` is its twin inside an event loop, for a coroutine probe. The deadline only
bounds a hang (a loaded machine is slow, not wrong): past it they raise an AssertionError naming `what`
and the last value seen (through `show`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

SHOWN_CHARS = 4000  # of the last value, in the message of a timeout


def _timed_out(timeout_s: float, what: str, value: Any, show: Callable[[Any], str]) -> AssertionError:
    shown = show(value)
    if len(shown) > SHOWN_CHARS:
        shown = shown[:SHOWN_CHARS] + " ..."
    return AssertionError(f"waited {timeout_s:g} s for {what}; last: {shown}")


def until(probe: Callable[[], T], timeout_s: float, what: str, *, ok: Callable[[T], Any] = bool,
          interval_s: float = 0.05, show: Callable[[T], str] = repr) -> T:
    """Call `probe()` until `ok(value)` (by default: the value is true) and return that value; after
    `timeout_s`, an AssertionError naming `what` and the last value. The probe is called at least once,
    and once more at the deadline; an exception it raises ends the wait (a process that died)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what, value, show)
        time.sleep(interval_s)


async def until_async(probe: Callable[[], Awaitable[T]], timeout_s: float, what: str, *,
                      ok: Callable[[T], Any] = bool, interval_s: float = 0.01, show: Callable[[T], str] = repr,
                      unless: asyncio.Future | None = None) -> T | None:
    """`until` inside an event loop, for a coroutine probe; sleeps with asyncio.sleep, so the loop's
    other tasks run meanwhile. `unless`: a future (the load a test is watching); once it is done
    before the state is seen, stop and return None."""
    deadline = time.monotonic() + timeout_s
    while unless is None or not unless.done():
        value = await probe()
        if ok(value):
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what, value, show)
        await asyncio.sleep(interval_s)
    return None
