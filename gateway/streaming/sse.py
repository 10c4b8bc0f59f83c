"""Server-Sent Events: the framing of an event, keep-alives, and the responses that carry them."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from common.events import event_payload
from gateway.streaming.departure import CancelledOnDeparture, disconnect_watch
from gateway.streaming.ids import Entry

KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_bytes(payload: Any) -> bytes:
    """`payload` as compact JSON, non-ASCII text as it is."""
    try:
        return orjson.dumps(payload)
    except orjson.JSONEncodeError:  # text orjson refuses (a lone surrogate): escaped, as json does
        return json.dumps(payload, separators=(",", ":")).encode()


def frame(data: bytes, event: str | None = None, entry_id: str | None = None) -> bytes:
    """One event: its `id` and `event` lines when it has them, then its data (one line of JSON)."""
    head = b"" if entry_id is None else b"id: %b\n" % entry_id.encode()
    if event is not None:
        head += b"event: %b\n" % event.encode()
    return b"%bdata: %b\n\n" % (head, data)


Render = Callable[[list[Entry]], bytes]
"""What a stream sends for entries that arrived together, as one chunk (b"": nothing)."""


def frames(entries: list[Entry]) -> bytes:
    """The SSE bytes of a job's entries, each as an event of its own (a job's event stream)."""
    return b"".join(
        frame(json_bytes(event_payload(fields)), fields.get("type", "message"), entry_id)
        for entry_id, fields in entries
    )


async def relay(
    read: AsyncGenerator[list[Entry] | None, None], render: Render = frames, opening: bytes = b""
) -> AsyncIterator[bytes]:
    """The SSE bytes of `batches`: `opening`, then the entries that arrived together as one chunk,
    or a keep-alive."""
    if opening:
        yield opening
    async with contextlib.aclosing(read):
        async for batch in read:
            if batch is None:
                yield KEEPALIVE
            elif chunk := render(batch):
                yield chunk


class EventStreamResponse(StreamingResponse):
    """Server-sent events that know whether they ran to their end: `ended` stays False when the client
    left first, for subclasses that then cancel what the stream was for. `on_end` is called once
    the stream is over, however it ended.

    Behind the gateway's own protocol a client that leaves cancels the stream from a callback (see
    gateway.streaming.departure); behind any other server Starlette watches receive() in a second task per
    stream."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self.ended = False
        self._chunks = self._to_the_end(content, on_end)
        super().__init__(
            self._chunks,
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **(headers or {})},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = disconnect_watch(scope)
        try:
            if watch is None:
                await super().__call__(scope, receive, send)
            else:
                with CancelledOnDeparture(watch):
                    await self.stream_response(send)
        finally:
            await self._chunks.aclose()  # its `on_end` has run, whichever way the stream ended

    async def _to_the_end(
        self, content: AsyncIterator[bytes], on_end: Callable[[], None] | None
    ) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in content:
                yield chunk
            self.ended = True
        finally:
            if on_end is not None:
                on_end()
            close = getattr(content, "aclose", None)
            if close is not None:
                await close()


async def nothing() -> AsyncGenerator[bytes, None]:
    return
    yield b""


class StreamEndpoint:
    """The endpoint of a route whose response may stay open for hours (an event stream), called as a
    plain ASGI app: an open stream then holds no frames of Starlette's per-route request wrapper
    (about 1.7 KB a stream). `handler` is written as for any route; an ApiError it raises is answered
    by the app's exception handlers, as from any other route."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]]) -> None:
        self.handler = handler
        functools.update_wrapper(self, handler)  # the route's name, and the Operation it declares

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handler(Request(scope, receive, send))
        await response(scope, receive, send)
