"""Reading one job's stream for a client: where a resumed read starts (`after`, Last-Event-ID), which
arrived entries to send, where the stream ends, and what a quiet spell means."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.events import TOKEN, is_final
from common.keys import Keyspace
from gateway.streaming.ids import Entry, KeyedEntry, parse_id
from gateway.streaming.relay import StreamRelay

logger = logging.getLogger(__name__)

PURGED = {"type": "error", "status": "failed", "message": "the job was purged", "code": "job_purged"}
STORE_LOST = {
    "type": "error",
    "status": "failed",
    "message": "the job store (Redis) lost its data, this job with it (it restarted without persistence); "
    "submit the job again",
    "code": "store_lost",
}


class StoreOutage(RedisConnectionError):
    """A wait on a job's stream gave up: its Redis stayed away for the relay's outage limit (a
    ConnectionError, so that the gateway answers it as any other: 503 `store_unavailable`)."""


async def read_position(redis: Redis, keys: Keyspace, job_id: str, after: str) -> str:
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
        return "ended" if parse_id(newest_id) <= parse_id(after) else "ok"
    return "beyond" if parse_id(after) > parse_id(newest_id) else "ok"


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


class JobStreamReading:
    """One reader's way through a job's stream after `after`: which arrived entries to send
    (SentTokens), where the stream ends (its final entry, or the relay's `outage_end` once Redis has been
    away for its outage limit), and what a quiet spell means (a keep-alive, Redis away too long, or the
    stream purged)."""

    __slots__ = ("_last_id", "_redis", "_sent", "_stream", "_streams", "job_id")

    def __init__(self, streams: StreamRelay, redis: Redis, job_id: str, after: str = "0-0") -> None:
        self._streams = streams
        self._redis = redis
        self.job_id = job_id
        self._stream = streams.keys.events(job_id)
        self._last_id = after  # of the last entry sent: a client that resumes from it misses nothing
        self._sent = SentTokens()

    def to_send(self, arrived: list[KeyedEntry]) -> tuple[list[Entry], bool]:
        """The entries of `arrived` to send, in order, and whether the final one is among them (what
        follows it is dropped)."""
        batch: list[Entry] = []
        for _key, entry_id, fields in arrived:
            if not self._sent.fresh(fields):
                continue
            batch.append((entry_id, fields))
            self._last_id = entry_id
            if is_final(fields):
                return batch, True
        return batch, False

    async def quiet(self) -> list[Entry] | None:
        """After a keep-alive interval with nothing new: None when a keep-alive is due, else the last
        entries to send before the stream ends (none: it ends now)."""
        if self._streams.outage_over():  # the relay ends its streams then: this one missed it
            logger.warning("job %s: Redis away too long, ending the stream", self.job_id)
            return [(self._last_id, self._streams.outage_end())]
        if self._streams.unreachable_for() is None:
            if await stream_exists(self._streams, self._redis, self._stream) is False:
                gone = STORE_LOST if self._streams.lost(self.job_id) else PURGED
                return [(f"{int(time.time() * 1000)}-0", gone)]
        return None


async def batches(
    streams: StreamRelay,
    redis: Redis,
    job_id: str,
    after: str,
    keepalive_s: float,
) -> AsyncGenerator[list[Entry] | None, None]:
    """The job's stream entries after `after` ("0-0" for all), then new ones as they come, until the
    final one: those that arrived together in one list; None where a keep-alive is due. `after` must
    stand before the final entry (`read_position` says "ok"; "0-0" always does).

    While Redis is away (a restart) the client keeps its connection and gets keep-alives; the relay
    goes on from the last entry it sent once Redis is back, or ends with an error entry (code
    `store_unavailable`) once Redis has been away for the relay's outage limit.
    """
    reading = JobStreamReading(streams, redis, job_id, after)
    async with streams.follow({streams.keys.events(job_id): after}) as follower:
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


async def stream_exists(streams: StreamRelay, redis: Redis, stream: str) -> bool | None:
    """Whether the stream is still there (expired or purged: it ends); None when Redis does not answer,
    which the relay counts as an outage (its limit ends the stream, as any other of that Redis)."""
    try:
        return bool(await redis.exists(stream))
    except (RedisConnectionError, RedisTimeoutError) as e:
        streams.unreachable(e)
        return None


async def wait_final(streams: StreamRelay, redis: Redis, job_id: str, timeout_s: float) -> None:
    """Return once the job's final event is in its stream, or after `timeout_s`; raises StoreOutage once
    Redis has been away for the relay's outage limit."""
    stream = streams.keys.events(job_id)
    newest = await redis.xrevrange(stream, count=1)
    if newest and is_final(newest[0][1]):
        return
    last = newest[0][0] if newest else "0-0"  # no stream yet: wait for its first entry
    deadline = time.monotonic() + timeout_s
    async with streams.follow({stream: last}) as follower:
        while (left := deadline - time.monotonic()) > 0:
            arrived = await follower.next(left)
            ended = streams.outage_end()
            if streams.outage_over() or any(fields == ended for _key, _id, fields in arrived):
                raise StoreOutage(ended["message"])
            if any(is_final(fields) for _key, _id, fields in arrived):
                return
