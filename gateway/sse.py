"""Relaying a job's Redis stream to a client as Server-Sent Events."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import orjson
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from common import keys
from common.events import event_payload, is_final
from common.wire import EventType
from gateway.departure import CancelledOnDeparture, disconnect_watch
from gateway.relay import StreamRelay

logger = logging.getLogger(__name__)

KEEPALIVE = b": keep-alive\n\n"
_ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})", re.ASCII)
_MAX_PART = 2**64 - 1
PURGED = {"type": "error", "status": "failed", "message": "the job was purged", "code": "job_purged"}


def valid_entry_id(text: str) -> bool:
    """A Redis stream id as `after` or Last-Event-ID may give it: ASCII digits, each part below 2**64."""
    match = _ENTRY_ID.fullmatch(text)
    return match is not None and all(int(part) <= _MAX_PART for part in match.groups())


def entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def read_position(redis: Redis, job_id: str, after: str) -> str:
    """Where `after` stands in the job's stream: "ended" when the final entry is at or before it
    (nothing more will come), "beyond" when it is past the newest entry of a stream still being
    written (no such event was ever sent), else "ok"."""
    if after == "0-0":
        return "ok"
    newest = await redis.xrevrange(keys.events(job_id), count=1)
    if not newest:
        return "ok"
    newest_id, fields = newest[0]
    if is_final(fields):
        return "ended" if entry_key(newest_id) <= entry_key(after) else "ok"
    return "beyond" if entry_key(after) > entry_key(newest_id) else "ok"


def frame(entry_id: str, fields: dict[str, str]) -> bytes:
    event = fields.get("type", "message")
    payload = event_payload(fields)
    try:
        data = orjson.dumps(payload)
    except orjson.JSONEncodeError:  # text orjson refuses (a lone surrogate): escaped, as json does
        data = json.dumps(payload, separators=(",", ":")).encode()
    return b"id: %b\nevent: %b\ndata: %b\n\n" % (entry_id.encode(), event.encode(), data)


Entry = tuple[str, dict[str, str]]


class SentTokens:
    """The token entries one reader was sent, by token index: an entry a worker wrote again after a Redis
    failover (the new primary lacked it, and this reader had it from the old one) is not sent twice."""

    def __init__(self) -> None:
        self.last_index = -1

    def fresh(self, fields: dict[str, str]) -> bool:
        """Whether to send the entry: anything but a token entry, or one past the last token sent."""
        if fields.get("type") != EventType.token.value or "index" not in fields:
            return True
        index = int(fields["index"])
        if index <= self.last_index:
            return False
        self.last_index = index
        return True


async def relay(read: AsyncGenerator[list[Entry] | None, None]) -> AsyncIterator[bytes]:
    """The SSE bytes of `batches`: the entries that arrived together as one chunk, or a keep-alive."""
    async with contextlib.aclosing(read):
        async for batch in read:
            yield KEEPALIVE if batch is None else b"".join(frame(*entry) for entry in batch)


async def entries(read: AsyncGenerator[list[Entry] | None, None]) -> AsyncGenerator[Entry | None, None]:
    """The entries of `batches` one at a time; None where a keep-alive is due."""
    async with contextlib.aclosing(read):
        async for batch in read:
            if batch is None:
                yield None
                continue
            for entry in batch:
                yield entry


async def batches(
    streams: StreamRelay,
    redis: Redis,
    job_id: str,
    after: str,
    keepalive_s: float,
    outage_limit_s: float = 60.0,
) -> AsyncGenerator[list[Entry] | None, None]:
    """The job's stream entries after `after` ("0-0" for all), then new ones as they come, until the
    final one: those that arrived together in one list; None where a keep-alive is due.

    While Redis is away (a restart) the client keeps its connection and gets keep-alives; the relay
    goes on from the last entry it sent once Redis is back, or ends after `outage_limit_s`.
    """
    stream = keys.events(job_id)
    if await read_position(redis, job_id, after) == "ended":
        return
    sent = SentTokens()
    async with streams.follow({stream: after}) as follower:
        while True:
            arrived = await follower.next(keepalive_s)
            if not arrived:
                away = streams.unreachable_for()
                if away is not None and away > outage_limit_s:
                    logger.warning("job %s: Redis away for %.0f s, ending the stream", job_id, away)
                    return
                if away is None and not await _exists(redis, stream):
                    yield [(f"{int(time.time() * 1000)}-0", PURGED)]
                    return
                yield None
                continue
            batch: list[Entry] = []
            for _key, entry_id, fields in arrived:
                if not sent.fresh(fields):
                    continue
                batch.append((entry_id, fields))
                if is_final(fields):
                    yield batch
                    return
            if batch:
                yield batch


async def _exists(redis: Redis, stream: str) -> bool:
    """Whether the stream is still there (expired or purged: it ends); True while Redis is away."""
    try:
        return bool(await redis.exists(stream))
    except (RedisConnectionError, RedisTimeoutError):
        return True


async def wait_final(streams: StreamRelay, redis: Redis, job_id: str, timeout_s: float) -> None:
    """Return once the job's final event is in its stream, or after `timeout_s`."""
    stream = keys.events(job_id)
    newest = await redis.xrevrange(stream, count=1)
    if newest and is_final(newest[0][1]):
        return
    last = newest[0][0] if newest else "0-0"  # no stream yet: wait for its first entry
    deadline = time.monotonic() + timeout_s
    async with streams.follow({stream: last}) as follower:
        while (left := deadline - time.monotonic()) > 0:
            if any(is_final(fields) for _key, _id, fields in await follower.next(left)):
                return


class EventStreamResponse(StreamingResponse):
    """Server-sent events that know whether they ran to their end: `ended` stays False when the client
    left first, for subclasses that then cancel what the stream was for. `on_end` is called once
    the stream is over, however it ended.

    Behind the gateway's own protocol a client that leaves cancels the stream from a callback (see
    gateway.departure); behind any other server Starlette watches receive() in a second task per stream."""

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
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
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


class StreamEndpoint:
    """The endpoint of a route whose response may stay open for hours (an event stream), called as a
    plain ASGI app: an open stream then holds no frames of Starlette's per-route request wrapper
    (about 1.7 KB a stream). `handler` is written as for any route; an ApiError it raises is answered
    by the app's exception handlers, as from any other route."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]]) -> None:
        self.handler = handler
        self.__name__ = handler.__name__  # the route's name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handler(Request(scope, receive, send))
        await response(scope, receive, send)
