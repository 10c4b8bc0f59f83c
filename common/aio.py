"""Running a process's event loop (uvloop where it is installed: cheaper socket I/O and wake-ups), waiting
in it, and ending its tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def wait_set(event: asyncio.Event, seconds: float) -> bool:
    """Waits until `event` is set, for `seconds` at most (none if not positive); whether it is set."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()


async def cancel_and_wait(task: asyncio.Task[Any], again_after_s: float = 1.0) -> None:
    """Cancels the task and waits for its end, cancelling it again every `again_after_s` while it runs on.
    Python 3.11's asyncio.wait_for (which redis-py calls for each command when it has a socket timeout)
    drops a cancellation that arrives just as the call it waits for completes; a task that loops until
    cancelled would then loop on, and whoever waits for it would wait forever."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=again_after_s)
    if not task.cancelled():
        task.exception()  # its outcome is of no interest, as with gather(..., return_exceptions=True)
