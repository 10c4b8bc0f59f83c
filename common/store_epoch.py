"""A Redis's data epoch: a random tag written once, when a process first finds the Redis without one. A
Redis that restarts without its data (no persistence) or loses it otherwise comes back without the tag;
the first process to notice writes a new one, and every process that knew the old tag then knows that
what the Redis held under it is gone.

Each job id carries the epoch of the Redis it was submitted to (`job_<epoch><random>`), so a job that
cannot be found can be told apart: gone with a lost epoch (`store_lost`) or never there, expired or
purged (`job_not_found`)."""

from __future__ import annotations

import secrets

from redis.asyncio import Redis

from common.keys import Keyspace

JOB_PREFIX = "job_"
EPOCH_CHARS = 8  # token_urlsafe(6)
_RANDOM_BYTES = 15  # 20 characters


def new_epoch() -> str:
    return secrets.token_urlsafe(6)


def new_job_id(epoch: str) -> str:
    """A job id that carries `epoch`, the epoch of the Redis the job is submitted to."""
    return JOB_PREFIX + epoch + secrets.token_urlsafe(_RANDOM_BYTES)


def epoch_of(job_id: str) -> str | None:
    """The epoch a job id carries; None for an id of another form (older ids carry none)."""
    if not job_id.startswith(JOB_PREFIX) or len(job_id) != len(JOB_PREFIX) + EPOCH_CHARS + 20:
        return None
    return job_id[len(JOB_PREFIX) : len(JOB_PREFIX) + EPOCH_CHARS]


async def current_epoch(redis: Redis, keys: Keyspace, ttl_s: int) -> str:
    """The Redis's epoch, written now if it has none (its first use, or its data was lost). Each read
    keeps it for `ttl_s` more (the job TTL): it lapses only once nothing read it for that long, when
    every job of its epoch has expired anyway."""
    epoch: str | None = await redis.getex(keys.epoch, ex=ttl_s)
    if epoch is None:
        await redis.set(keys.epoch, new_epoch(), nx=True, ex=ttl_s)
        epoch = await redis.get(keys.epoch)
    return epoch or ""


async def note_lost(redis: Redis, keys: Keyspace, epoch: str, ttl_s: int) -> None:
    """Records in the Redis that `epoch` was lost, for processes that never knew it (a gateway started
    since): its jobs answer `store_lost` until they would have expired anyway."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.sadd(keys.lost_epochs, epoch)
        pipe.expire(keys.lost_epochs, ttl_s)
        await pipe.execute()


async def was_lost(redis: Redis, keys: Keyspace, epoch: str) -> bool:
    return bool(await redis.sismember(keys.lost_epochs, epoch))  # type: ignore[misc]
