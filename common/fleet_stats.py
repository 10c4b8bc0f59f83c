"""Fleet figures read straight from Redis: queue depth per model and jobs finished in the last minute.

The gateway's /metrics and `ortfleet status` both read them here, so they agree with each other and
stay right with any number of gateways.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from redis.asyncio import Redis

from common import keys

RECENT_WINDOW_S = 60


@dataclass(frozen=True)
class QueueStats:
    depth: int  # jobs waiting in the model's queue
    oldest_wait_s: float  # how long the longest-waiting fresh submission has waited (0 when none)


@dataclass(frozen=True)
class RecentOutcomes:
    """Jobs of a model that finished on a worker in the last minute, by status."""

    by_status: Counter[str] = field(default_factory=Counter)

    @property
    def finished(self) -> int:
        return sum(self.by_status.values())

    @property
    def failed(self) -> int:
        return self.by_status["failed"]


async def queue_stats(redis: Redis, models: list[str], now: float | None = None) -> dict[str, QueueStats]:
    now = time.time() if now is None else now
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.zcard(keys.queue(model))
            # Score 0 marks a job handed back to the head of the queue; its submission time is elsewhere.
            pipe.zrangebyscore(keys.queue(model), "(0", "+inf", start=0, num=1, withscores=True)
        replies = await pipe.execute()
    stats: dict[str, QueueStats] = {}
    for index, model in enumerate(models):
        depth, oldest = replies[2 * index], replies[2 * index + 1]
        wait = max(0.0, now - oldest[0][1] / 1000) if oldest else 0.0
        stats[model] = QueueStats(int(depth), wait)
    return stats


async def record_outcome(
    redis: Redis, model: str, job_id: str, status: str, now: float | None = None
) -> None:
    """Note that a job finished (status: succeeded, failed or cancelled); older notes are dropped."""
    now_ms = int((time.time() if now is None else now) * 1000)
    key = keys.finished(model)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zadd(key, {f"{status}:{job_id}": now_ms})
        pipe.zremrangebyscore(key, "-inf", now_ms - RECENT_WINDOW_S * 1000)
        pipe.pexpire(key, 2 * RECENT_WINDOW_S * 1000)
        await pipe.execute()


async def recent_outcomes(
    redis: Redis, models: list[str], now: float | None = None
) -> dict[str, RecentOutcomes]:
    since_ms = int((time.time() if now is None else now) * 1000) - RECENT_WINDOW_S * 1000
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.zrangebyscore(keys.finished(model), since_ms, "+inf")
        replies: list[list[str]] = await pipe.execute()
    return {
        model: RecentOutcomes(Counter(member.split(":", 1)[0] for member in members))
        for model, members in zip(models, replies, strict=True)
    }


async def known_models(redis: Redis) -> list[str]:
    """Every model a worker registered within the job TTL, sorted."""
    names: list[str] = await redis.hkeys(keys.MODELS)  # type: ignore[misc]
    return sorted(names)
