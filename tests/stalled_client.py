"""A connection whose client stops reading, for streams written from the relay's callback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.asyncio import Redis

from common.events import done_entry
from common.wire import JobStatus, Usage
from gateway.streaming.relay import StreamRelay
from tests.redis_events import add_entry, add_tokens, relay_reads_to_the_end
from tests.waiting import until

TOKENS = [f"t{i} " for i in range(40)]  # the texts `stall_mid_stream` writes, in order
USAGE = Usage(prompt_tokens=1, completion_tokens=40, total_tokens=41)  # in its final entry


class StallingBody:
    """A connection whose client stops reading once `stalled` is set: a write then says the connection
    is full, and `drain` waits until the client reads again."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.stalled = False
        self.reading = asyncio.Event()

    def write(self, data: bytes) -> bool:
        self.written.append(data)
        return not self.stalled

    async def drain(self) -> None:
        await self.reading.wait()


async def stall_mid_stream(
    redis: Redis,
    relay: StreamRelay,
    stream: str,
    body: StallingBody,
    texts: Callable[[], list[str]],
    pauses: Callable[[], int],
    writing: asyncio.Task[None],
) -> None:
    """Drives a stream that `writing` pushes to `body` through a stall: ten tokens the client reads, ten
    in which its connection fills, twenty more and the final entry while it reads nothing (none of
    them may be written to it, and one pause counted), then the client reads again and the stream must
    run to its end. `texts` gives the token texts written so far."""
    await add_tokens(redis, stream, range(10))
    await until(lambda: len(texts()) == 10, "the first ten tokens written", 10)
    body.stalled = True
    await add_tokens(redis, stream, range(10, 20))
    await until(lambda: len(texts()) > 10, "a write that finds the connection full", 10)
    stalled_at = len(body.written)
    await add_tokens(redis, stream, range(20, 40))
    await add_entry(redis, stream, done_entry(JobStatus.succeeded, "length", USAGE.model_dump_json()))
    await relay_reads_to_the_end(relay, stream)
    assert len(body.written) == stalled_at  # none of it went to the stalled client
    assert pauses() == 1
    body.stalled = False
    body.reading.set()
    await asyncio.wait_for(writing, 10)
