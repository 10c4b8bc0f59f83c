"""Writing a response's body straight to the connection (DIRECT_BODY_EXTENSION, offered by the gateway's
own HTTP protocol), and pacing those writes to a client that reads slowly."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.types import Send

from gateway.streaming.departure import CancelledOnDeparture, DisconnectWatch
from gateway.streaming.follower import WakeableSleep

DIRECT_BODY_EXTENSION = "ortfleet.direct_body"


class DirectBody(Protocol):
    """A request's DIRECT_BODY_EXTENSION, offered by the gateway's own HTTP protocol: once the response
    has started (its head sent through the app's `send`, so middlewares see it) with a chunked body,
    `write` sends one chunk straight to the connection (dropped once the client is gone, as `send` drops
    it). It returns False when the client reads slower than the stream writes (the connection holds
    more than its high-water mark): write no more until `drain` returns. No middleware sees these
    chunks, so it suits only responses whose body no middleware changes (none of the gateway's does)."""

    def write(self, data: bytes) -> bool: ...

    async def drain(self) -> None: ...


def direct_body(scope: Any) -> DirectBody | None:
    body: DirectBody | None = scope.get("extensions", {}).get(DIRECT_BODY_EXTENSION)
    return body


class Pausable(Protocol):
    """What a pushed stream reads from (a Follower, or the ChoiceEvents of an OpenAI request)."""

    @property
    def behind(self) -> bool: ...

    def pause(self) -> None: ...

    def rejoin(self) -> None: ...


class PushedWrites:
    """The writes of a stream pushed from the relay's callback to a DirectBody, and the pace of the
    stream's task. A write that finds the connection full pauses `source` (no more entries until the
    client has caught up; it then reads on from Redis) and calls `on_pause`. The task waits in `idle`
    for a keep-alive to be due, a slow client to catch up, or a `wake`."""

    __slots__ = ("_body", "_keepalive_s", "_last_write", "_on_pause", "_sleep", "_source")

    def __init__(
        self, body: DirectBody, source: Pausable, keepalive_s: float, on_pause: Callable[[], None]
    ) -> None:
        self._body = body
        self._source = source
        self._keepalive_s = keepalive_s
        self._on_pause = on_pause
        self._last_write = asyncio.get_running_loop().time()
        self._sleep = WakeableSleep()

    def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._last_write = asyncio.get_running_loop().time()
        if not self._body.write(chunk) and not self._source.behind:
            self._source.pause()
            self._on_pause()
            self._sleep.wake()

    def wake(self) -> None:
        """Ends the task's `idle` now: the stream's state changed (it ended, or failed)."""
        self._sleep.wake()

    async def idle(self) -> bool:
        """Waits for the task's next turn: True once a keep-alive interval has passed with nothing
        written; False when woken earlier, or once a slow client has caught up (`source` reads on)."""
        if self._source.behind:
            await self._body.drain()
            self._source.rejoin()
            return False
        quiet_for = asyncio.get_running_loop().time() - self._last_write
        if quiet_for < self._keepalive_s:
            await self._sleep(self._keepalive_s - quiet_for)
            return False
        return True


async def write_direct(
    send: Send,
    headers: list[tuple[bytes, bytes]],
    watch: DisconnectWatch,
    write: Callable[[], Awaitable[None]],
) -> bool:
    """A 200 response whose body `write` sends straight to the connection (a DirectBody): the head goes
    through `send` (so middlewares see it), then `write` runs, then the body ends. A client that leaves
    cancels `write`. True when `write` ran to its end, False when the client left first."""
    ran = False
    with CancelledOnDeparture(watch) as departure:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await write()
        ran = True
    if not departure.left:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return ran
