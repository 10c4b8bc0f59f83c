"""Waiting for a state that no event announces (one kept by timers, or by another process)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def until(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Until `condition()` holds; fails the test, saying `what` did not happen, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        await asyncio.sleep(0.05)


async def until_seen(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float) -> None:
    """Until `await check()` is true (a state read over the network); fails the test as `until` does."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        await asyncio.sleep(0.05)
