"""Setting up and waiting on a job's Redis record and stream directly, for tests that drive workers or
their writers without a gateway."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from common.events import is_final, token_entry
from common.jobs.reads import notice_streams
from gateway.streaming.relay import StreamRelay
from tests.conftest import keys


async def fresh_jobs(redis: Redis, *job_ids: str, attempt: int = 1) -> None:
    """Jobs with no stream yet, each owned by its `attempt`."""
    for job_id in job_ids:
        await redis.delete(keys.job(job_id), keys.events(job_id))
        await redis.hset(keys.job(job_id), mapping={"attempts": str(attempt)})


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
        notice_streams(pipe, keys, [stream])
        entry_id, _ = await pipe.execute()
    return str(entry_id)


async def add_tokens(redis: Redis, stream: str, indexes: range) -> None:
    """Token entries `t{i} ` for each index, added together with one notice, as one engine step's."""
    async with redis.pipeline(transaction=False) as pipe:
        for i in indexes:
            pipe.xadd(stream, token_entry(f"t{i} ", [i], i))  # type: ignore[arg-type]
        notice_streams(pipe, keys, [stream])
        await pipe.execute()


async def relay_reads_to_the_end(relay: StreamRelay, stream: str) -> None:
    """Until a reader of `relay` has had every entry of `stream` up to its final one: the relay has
    read them all from Redis."""
    async with relay.follow({stream: "0-0"}) as witness:
        entries = []
        while not entries or not is_final(entries[-1][2]):
            entries += await witness.next(10)


async def lose_newest_tokens(redis: Redis, job_id: str, keep: int) -> None:
    """What a failover to a replica that missed the newest writes does: token entries from index `keep` on
    are gone (`keep` must be where an entry starts)."""
    for entry_id, fields in await redis.xrange(keys.events(job_id)):
        if fields.get("type") == "token" and int(fields["index"]) >= keep:
            await redis.xdel(keys.events(job_id), entry_id)
    await redis.hset(keys.job(job_id), "streamed", str(keep))
