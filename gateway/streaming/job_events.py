"""A job's stream as Server-Sent Events (`GET /v1/jobs/{id}/events`, and Responses' streams): written
from the relay's callback behind the gateway's own protocol, by generators behind any other server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.streaming.departure import disconnect_watch
from gateway.streaming.direct import DirectBody, PushedWrites, direct_body, write_direct
from gateway.streaming.follower import Follower
from gateway.streaming.reading import JobStreamReading, batches
from gateway.streaming.relay import StreamRelay
from gateway.streaming.sse import KEEPALIVE, SSE_HEADERS, EventStreamResponse, Render, frames, nothing, relay


@dataclass(slots=True, eq=False)
class PushedStream:
    """A job's stream written to the connection from the relay's callback as each read hands its
    entries over (as `render` makes them into bytes): the stream's task wakes only for a keep-alive, a
    client that reads too slowly, and the end."""

    body: DirectBody
    reading: JobStreamReading
    keepalive_s: float
    on_pause: Callable[[], None]
    render: Render = frames
    _ended: bool = field(default=False, init=False)
    _follower: Follower = field(init=False)
    _writes: PushedWrites = field(init=False)

    async def run(self, streams: StreamRelay, after: str, opening: bytes = b"") -> None:
        """Writes `opening`, then the stream after `after`, up to its final entry."""
        # the relay hands entries over from its next read, never within this call
        self._follower = streams.follower({streams.keys.events(self.reading.job_id): after}, self._arrived)
        self._writes = writes = PushedWrites(self.body, self._follower, self.keepalive_s, self.on_pause)
        try:
            writes.write(opening)
            while not self._ended:
                if not await writes.idle():
                    continue
                last = await self.reading.quiet()
                if last is None:
                    writes.write(KEEPALIVE)
                    continue
                if last:
                    writes.write(self.render(last))
                return
        finally:
            self._follower.close()

    def _arrived(self) -> None:
        entries = self._follower.take()
        if self._ended:
            return
        batch, self._ended = self.reading.to_send(entries)
        if batch:
            self._writes.write(self.render(batch))
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
        super().__init__(nothing(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, watch = direct_body(scope), disconnect_watch(scope)
        if body is None or watch is None or scope["method"] == "HEAD":
            relayed = (
                nothing() if self._past_end else relay(batches(*self._source), self._render, self._opening)
            )
            response = EventStreamResponse(relayed, on_end=self._on_end)
            await response(scope, receive, send)
            self.ended = response.ended
            return
        streams, redis, job_id, after, keepalive_s = self._source

        async def write() -> None:
            if not self._past_end:
                reading = JobStreamReading(streams, redis, job_id, after)
                pushed = PushedStream(body, reading, keepalive_s, self._on_pause, self._render)
                await pushed.run(streams, after, self._opening)

        try:
            self.ended = await write_direct(send, self.raw_headers, watch, write)
        finally:
            self._on_end()
