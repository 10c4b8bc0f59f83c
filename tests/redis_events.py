"""Waiting on a job's Redis stream directly, for tests that drive workers without a gateway."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from common import keys
from common.jobqueue import notice_streams


async def wait_final(redis: Redis, job_id: str, timeout_s: float = 20.0) -> dict[str, str]:
    """The job's record once its final event is in its stream."""
    last = "0-0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = await redis.xread({keys.events(job_id): last}, block=200)
        for entry_id, fields in reply[0][1] if reply else []:
            last = entry_id
            if fields["type"] in ("done", "error"):
                record: dict[str, str] = await redis.hgetall(keys.job(job_id))  # type: ignore[misc]
                return record
    raise AssertionError(f"job {job_id} did not finish within {timeout_s} s")


async def wait_for_tokens(redis: Redis, job_id: str, count: int) -> None:
    """Until `count` token events are in the job's stream."""
    last, seen = "0-0", 0
    while seen < count:
        reply = await redis.xread({keys.events(job_id): last}, block=1000)
        for entry_id, fields in reply[0][1] if reply else []:
            last = entry_id
            seen += fields["type"] == "token"


async def add_entry(redis: Redis, stream: str, fields: dict[str, str]) -> str:
    """Adds an entry to a job stream as the job scripts do: with a notice to the gateways' relays."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xadd(stream, fields)  # type: ignore[arg-type]
        notice_streams(pipe, [stream])
        entry_id, _ = await pipe.execute()
    return str(entry_id)
