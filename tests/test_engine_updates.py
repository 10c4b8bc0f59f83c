"""How a request's engine updates reach the event loop: taken one at a time, or handed to a consumer."""

from __future__ import annotations

import asyncio

import pytest

from worker.engine import EngineUpdate, Finish, UpdateQueue

pytestmark = pytest.mark.unit  # no process: the first tier


async def test_get_waits_for_the_next_update_and_takes_them_in_order() -> None:
    updates = UpdateQueue()
    waiting = asyncio.create_task(updates.get())
    await asyncio.sleep(0)
    assert not waiting.done()

    updates.put_nowait(EngineUpdate([1]))
    updates.put_nowait(EngineUpdate([2], Finish.length))

    assert (await waiting).token_ids == [1]
    assert (await updates.get()).finish is Finish.length


async def test_a_consumer_gets_the_waiting_updates_first_then_each_as_it_is_put() -> None:
    updates = UpdateQueue()
    updates.put_nowait(EngineUpdate([1]))
    updates.put_nowait(EngineUpdate([2]))
    seen: list[int] = []

    updates.consume(lambda update: seen.extend(update.token_ids))
    assert seen == [1, 2]
    updates.put_nowait(EngineUpdate([3]))

    assert seen == [1, 2, 3]  # in the putter's own call: no task switch
