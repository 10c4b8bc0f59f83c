"""Running a process's event loop (uvloop where it is installed: cheaper socket I/O and wake-ups), and
waiting in it."""

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
