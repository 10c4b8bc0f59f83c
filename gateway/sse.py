"""Relaying a job's Redis stream to a client as Server-Sent Events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import keys
from common.events import event_payload, is_final

logger = logging.getLogger(__name__)

ENTRY_ID = re.compile(r"^\d+-\d+$")
KEEPALIVE = b": keep-alive\n\n"


def frame(entry_id: str, fields: dict[str, str]) -> bytes:
    event = fields.get("type", "message")
    data = json.dumps(event_payload(fields), ensure_ascii=False, separators=(",", ":"))
    return f"id: {entry_id}\nevent: {event}\ndata: {data}\n\n".encode()


async def relay(
    redis: Redis, job_id: str, after: str, keepalive_s: float, outage_limit_s: float = 60.0
) -> AsyncIterator[bytes]:
    """Every entry after `after` ("0-0" for all), then new ones as they come, until the final one.

    While Redis is away (a restart) the client keeps its connection and gets keep-alives; the relay
    goes on from the last entry it sent once Redis is back, or ends after `outage_limit_s`.
    """
    # One connection for the stream's life: a blocking read per event without a pool round trip.
    async with (
        redis.client() as pinned,
        contextlib.aclosing(_relay(pinned, job_id, after, keepalive_s, outage_limit_s)) as chunks,
    ):
        async for chunk in chunks:
            yield chunk


async def _relay(
    redis: Redis, job_id: str, after: str, keepalive_s: float, outage_limit_s: float
) -> AsyncGenerator[bytes, None]:
    stream = keys.events(job_id)
    last = after
    outage_since: float | None = None
    while True:
        try:
            reply = await redis.xread({stream: last}, count=512, block=int(keepalive_s * 1000))
            outage_since = None
        except (RedisConnectionError, RedisTimeoutError) as e:
            now = time.monotonic()
            outage_since = outage_since or now
            if now - outage_since > outage_limit_s:
                logger.warning("job %s: Redis away for %.0f s, ending the stream", job_id, now - outage_since)
                return
            logger.info("job %s: Redis unreachable (%s); the stream waits", job_id, e)
            yield KEEPALIVE
            await asyncio.sleep(0.25)
            continue
        if not reply:
            if not await redis.exists(stream):
                return
            yield KEEPALIVE
            continue
        for entry_id, fields in reply[0][1]:
            last = entry_id
            yield frame(entry_id, fields)
            if is_final(fields):
                return


async def wait_final(redis: Redis, job_id: str, timeout_s: float) -> None:
    """Return once the job's final event is in its stream, or after `timeout_s`."""
    stream = keys.events(job_id)
    newest = await redis.xrevrange(stream, count=1)
    if newest and is_final(newest[0][1]):
        return
    last = newest[0][0] if newest else "0-0"  # no stream yet: wait for its first entry
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        reply = await redis.xread({stream: last}, count=512, block=max(1, int(left * 1000)))
        if not reply:
            return
        for entry_id, fields in reply[0][1]:
            last = entry_id
            if is_final(fields):
                return
