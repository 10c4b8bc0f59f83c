"""CancelledOnDeparture: a client's leaving ends the block it waits in, and nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.streaming.departure import CancelledOnDeparture

pytestmark = pytest.mark.unit  # no process: the first tier


class Connection:
    """What the gateway's protocol does for DISCONNECT_EXTENSION: callbacks called once it closes."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        self.callbacks.append(callback)
        return lambda: self.callbacks.remove(callback)

    def close(self) -> None:
        for callback in list(self.callbacks):
            callback()


async def test_a_client_that_leaves_ends_the_wait_and_the_code_after_the_block_runs_on() -> None:
    connection = Connection()
    waiting = asyncio.Event()

    async def request() -> str:
        with CancelledOnDeparture(connection.watch) as departure:
            waiting.set()
            await asyncio.Event().wait()  # a wait that nothing else ends
        await asyncio.sleep(0)  # the task is not left cancelled
        return f"left={departure.left}"

    task = asyncio.create_task(request())
    await waiting.wait()
    connection.close()
    assert await asyncio.wait_for(task, 5) == "left=True"
    assert connection.callbacks == []


async def test_a_block_that_ends_first_stops_its_watch_and_is_not_cancelled_later() -> None:
    connection = Connection()
    with CancelledOnDeparture(connection.watch) as departure:
        await asyncio.sleep(0)
    assert connection.callbacks == [] and not departure.left
    connection.close()
    await asyncio.sleep(0)  # would raise CancelledError had the late departure reached this task


async def test_a_cancel_from_elsewhere_goes_on_even_when_the_client_left_too() -> None:
    connection = Connection()
    waiting = asyncio.Event()

    async def request() -> None:
        with CancelledOnDeparture(connection.watch):
            waiting.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(request())
    await waiting.wait()
    task.cancel()  # the server shutting down, say
    connection.close()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
