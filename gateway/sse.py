"""Relaying a job's Redis stream to a client as Server-Sent Events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from common import keys
from common.events import TOKEN, event_payload, is_final
from gateway.departure import CancelledOnDeparture, disconnect_watch
from gateway.relay import Entry as RelayEntry
from gateway.relay import StreamRelay, WakeableSleep

logger = logging.getLogger(__name__)

DIRECT_BODY_EXTENSION = "ortfleet.direct_body"

KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})", re.ASCII)
_MAX_PART = 2**64 - 1
PURGED = {"type": "error", "status": "failed", "message": "the job was purged", "code": "job_purged"}
STORE_LOST = {
    "type": "error",
    "status": "failed",
    "message": "the job store (Redis) lost its data, this job with it (it restarted without persistence); "
    "submit the job again",
    "code": "store_lost",
}


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


def json_bytes(payload: Any) -> bytes:
    """`payload` as compact JSON, non-ASCII text as it is."""
    try:
        return orjson.dumps(payload)
    except orjson.JSONEncodeError:  # text orjson refuses (a lone surrogate): escaped, as json does
        return json.dumps(payload, separators=(",", ":")).encode()


def frame(entry_id: str, fields: dict[str, str]) -> bytes:
    event = fields.get("type", "message")
    data = json_bytes(event_payload(fields))
    return b"id: %b\nevent: %b\ndata: %b\n\n" % (entry_id.encode(), event.encode(), data)


Entry = tuple[str, dict[str, str]]

Render = Callable[[list[Entry]], bytes]
"""What a stream sends for entries that arrived together, as one chunk (b"": nothing)."""


def frames(entries: list[Entry]) -> bytes:
    """The SSE bytes of a job's entries, each as an event of its own (a job's event stream)."""
    return b"".join(frame(*entry) for entry in entries)


OUTAGE_LIMIT_S = 60.0  # how long a stream waits for Redis to come back before it ends


class SentTokens:
    """The token entries one reader was sent, by token index: an entry a worker wrote again after a Redis
    failover (the new primary lacked it, and this reader had it from the old one) is not sent twice."""

    def __init__(self) -> None:
        self.last_index = -1

    def fresh(self, fields: dict[str, str]) -> bool:
        """Whether to send the entry: anything but a token entry, or one past the last token sent."""
        if fields.get("type") != TOKEN or "index" not in fields:
            return True
        index = int(fields["index"])
        if index <= self.last_index:
            return False
        self.last_index = index
        return True


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


class JobStreamReading:
    """One reader's way through a job's stream: which arrived entries to send (SentTokens), where the
    stream ends (its final entry), and what a quiet spell means (a keep-alive, Redis away too long, or
    the stream purged)."""

    __slots__ = ("_outage_limit_s", "_redis", "_sent", "_stream", "_streams", "job_id")

    def __init__(self, streams: StreamRelay, redis: Redis, job_id: str, outage_limit_s: float) -> None:
        self._streams = streams
        self._redis = redis
        self.job_id = job_id
        self._stream = keys.events(job_id)
        self._outage_limit_s = outage_limit_s
        self._sent = SentTokens()

    def to_send(self, arrived: list[RelayEntry]) -> tuple[list[Entry], bool]:
        """The entries of `arrived` to send, in order, and whether the final one is among them (what
        follows it is dropped)."""
        batch: list[Entry] = []
        for _key, entry_id, fields in arrived:
            if not self._sent.fresh(fields):
                continue
            batch.append((entry_id, fields))
            if is_final(fields):
                return batch, True
        return batch, False

    async def quiet(self) -> list[Entry] | None:
        """After a keep-alive interval with nothing new: None when a keep-alive is due, else the last
        entries to send before the stream ends (none: it ends now)."""
        away = self._streams.unreachable_for()
        if away is not None and away > self._outage_limit_s:
            logger.warning("job %s: Redis away for %.0f s, ending the stream", self.job_id, away)
            return []
        if away is None and not await stream_exists(self._redis, self._stream):
            gone = STORE_LOST if self._streams.lost(self.job_id) else PURGED
            return [(f"{int(time.time() * 1000)}-0", gone)]
        return None


async def batches(
    streams: StreamRelay,
    redis: Redis,
    job_id: str,
    after: str,
    keepalive_s: float,
    outage_limit_s: float = OUTAGE_LIMIT_S,
) -> AsyncGenerator[list[Entry] | None, None]:
    """The job's stream entries after `after` ("0-0" for all), then new ones as they come, until the
    final one: those that arrived together in one list; None where a keep-alive is due. `after` must
    stand before the final entry (`read_position` says "ok"; "0-0" always does).

    While Redis is away (a restart) the client keeps its connection and gets keep-alives; the relay
    goes on from the last entry it sent once Redis is back, or ends after `outage_limit_s`.
    """
    reading = JobStreamReading(streams, redis, job_id, outage_limit_s)
    async with streams.follow({keys.events(job_id): after}) as follower:
        while True:
            arrived = await follower.next(keepalive_s)
            if not arrived:
                last = await reading.quiet()
                if last is None:
                    yield None
                    continue
                if last:
                    yield last
                return
            batch, final = reading.to_send(arrived)
            if batch:
                yield batch
            if final:
                return


async def stream_exists(redis: Redis, stream: str) -> bool:
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


class PushedStream:
    """A job's stream written to the connection from the relay's callback as each read hands its
    entries over (as `render` makes them into bytes): the stream's task wakes only for a keep-alive, a
    client that reads too slowly, and the end."""

    __slots__ = (
        "_body",
        "_ended",
        "_follower",
        "_keepalive_s",
        "_on_pause",
        "_reading",
        "_render",
        "_writes",
    )

    def __init__(
        self,
        body: DirectBody,
        reading: JobStreamReading,
        keepalive_s: float,
        on_pause: Callable[[], None],
        render: Render = frames,
    ) -> None:
        self._body = body
        self._on_pause = on_pause
        self._reading = reading
        self._keepalive_s = keepalive_s
        self._render = render
        self._ended = False

    async def run(self, streams: StreamRelay, after: str, opening: bytes = b"") -> None:
        """Writes `opening`, then the stream after `after`, up to its final entry."""
        # the relay hands entries over from its next read, never within this call
        self._follower = streams.follower({keys.events(self._reading.job_id): after}, self._arrived)
        self._writes = writes = PushedWrites(self._body, self._follower, self._keepalive_s, self._on_pause)
        try:
            writes.write(opening)
            while not self._ended:
                if not await writes.idle():
                    continue
                last = await self._reading.quiet()
                if last is None:
                    writes.write(KEEPALIVE)
                    continue
                if last:
                    writes.write(self._render(last))
                return
        finally:
            self._follower.close()

    def _arrived(self) -> None:
        entries = self._follower.take()
        if self._ended:
            return
        batch, self._ended = self._reading.to_send(entries)
        if batch:
            self._writes.write(self._render(batch))
        if self._ended:
            self._writes.wake()


class JobEventsResponse(StreamingResponse):
    """A job's stream after `after`, as Server-Sent Events: `opening`, then what `render` makes of each
    read's entries (by default each entry as an event of its own). `past_end` says that `after` is at or
    past the final entry (`read_position`), so nothing follows. `on_end` is called once the stream is
    over, however it ended, and `on_pause` each time it stops writing for a client that reads too
    slowly; `ended` says afterwards whether it ran to its end (the client did not leave first).

    Behind the gateway's own protocol (DIRECT_BODY_EXTENSION, DISCONNECT_EXTENSION) the relay's
    callback renders each read's entries and writes them straight to the connection, in the relay's own
    turn of the event loop: no task wakes, no generator resumes and no ASGI send chain runs per event.
    Behind any other server the same reading runs as generators (`batches`)."""

    def __init__(
        self,
        streams: StreamRelay,
        redis: Redis,
        job_id: str,
        after: str,
        keepalive_s: float,
        on_end: Callable[[], None],
        on_pause: Callable[[], None] = lambda: None,
        *,
        past_end: bool = False,
        render: Render = frames,
        opening: bytes = b"",
    ) -> None:
        self._source = (streams, redis, job_id, after, keepalive_s)
        self._past_end = past_end
        self._render = render
        self._opening = opening
        self._on_end = on_end
        self._on_pause = on_pause
        self.ended = False
        super().__init__(_nothing(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, watch = direct_body(scope), disconnect_watch(scope)
        if body is None or watch is None or scope["method"] == "HEAD":
            relayed = (
                _nothing() if self._past_end else relay(batches(*self._source), self._render, self._opening)
            )
            response = EventStreamResponse(relayed, on_end=self._on_end)
            await response(scope, receive, send)
            self.ended = response.ended
            return
        streams, redis, job_id, after, keepalive_s = self._source
        try:
            with CancelledOnDeparture(watch) as departure:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                if not self._past_end:
                    reading = JobStreamReading(streams, redis, job_id, OUTAGE_LIMIT_S)
                    pushed = PushedStream(body, reading, keepalive_s, self._on_pause, self._render)
                    await pushed.run(streams, after, self._opening)
            self.ended = not departure.left
            if self.ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._on_end()


async def _nothing() -> AsyncGenerator[bytes, None]:
    return
    yield b""


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
