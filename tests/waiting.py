"""Waiting for a state that no event announces (one kept by timers, or by another process)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Until `condition()` holds; fails the test, saying `what` did not happen, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        await asyncio.sleep(0.05)
