"""A connection whose client stops reading, for streams written from the relay's callback."""

from __future__ import annotations

import asyncio


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
