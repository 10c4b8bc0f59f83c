"""Relaying a job's Redis stream to a client as Server-Sent Events."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from common import keys
from common.events import event_payload, is_final

ENTRY_ID = re.compile(r"^\d+-\d+$")
KEEPALIVE = b": keep-alive\n\n"


def frame(entry_id: str, fields: dict[str, str]) -> bytes:
    event = fields.get("type", "message")
    data = json.dumps(event_payload(fields), ensure_ascii=False, separators=(",", ":"))
    return f"id: {entry_id}\nevent: {event}\ndata: {data}\n\n".encode()


async def relay(redis: Redis, job_id: str, after: str, keepalive_s: float) -> AsyncIterator[bytes]:
    """Every entry after `after` ("0-0" for all), then new ones as they come, until the final one."""
    stream = keys.events(job_id)
    last = after
    while True:
        reply = await redis.xread({stream: last}, count=512, block=int(keepalive_s * 1000))
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
    import time

    stream = keys.events(job_id)
    newest = await redis.xrevrange(stream, count=1)
    if not newest or is_final(newest[0][1]):
        return
    last = newest[0][0]
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        reply = await redis.xread({stream: last}, count=512, block=max(1, int(left * 1000)))
        if not reply:
            return
        for entry_id, fields in reply[0][1]:
            last = entry_id
            if is_final(fields):
                return
