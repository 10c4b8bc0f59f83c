"""Fleet figures read straight from Redis: queue depth per model and jobs finished in the last minute.

The gateway's /metrics and `ortfleet status` both read them here, so they agree with each other and
stay right with any number of gateways.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TypeVar

from redis.asyncio import Redis

from common.keys import Keyspace
from common.wire import PRIORITY_ORDER

RECENT_WINDOW_S = 60


# Jobs read at the head of each class's queue to find the longest wait: the queue is ordered by fair
# share, not by age, so the oldest job is usually, not always, among them.
_OLDEST_SCAN = 16


@dataclass(frozen=True)
class QueueStats:
    depth: int  # jobs waiting in the model's queues
    oldest_wait_s: float  # how long the longest-waiting job near a queue's head has waited (0 when none)
    by_class: dict[str, int] = field(default_factory=dict)  # jobs waiting per priority class
    waiting_keys: dict[str, int] = field(default_factory=dict)  # "<class>:<key>" -> jobs near the heads

    def __add__(self, other: QueueStats) -> QueueStats:
        """The figures of one model's queues on two Redis stores, together."""
        return QueueStats(
            self.depth + other.depth,
            max(self.oldest_wait_s, other.oldest_wait_s),
            dict(Counter(self.by_class) + Counter(other.by_class)),
            dict(Counter(self.waiting_keys) + Counter(other.waiting_keys)),
        )


@dataclass(frozen=True)
class RecentOutcomes:
    """Jobs of a model that ended in the last minute, by status: on a worker, or cancelled or expired
    while queued (noted by the queue's scripts)."""

    by_status: Counter[str] = field(default_factory=Counter)

    def __add__(self, other: RecentOutcomes) -> RecentOutcomes:
        return RecentOutcomes(self.by_status + other.by_status)

    @property
    def finished(self) -> int:
        return sum(self.by_status.values())

    @property
    def failed(self) -> int:
        return self.by_status["failed"]


async def queue_stats(
    redis: Redis, keys: Keyspace, models: list[str], now: float | None = None
) -> dict[str, QueueStats]:
    now = time.time() if now is None else now
    classes = [cls.value for cls in PRIORITY_ORDER]
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            for cls in classes:
                pipe.zcard(keys.queue(model, cls))
                pipe.zrange(keys.queue(model, cls), 0, _OLDEST_SCAN - 1)
        replies = await pipe.execute()
    heads: list[tuple[str, str, str]] = []  # (model, class, job id)
    depths: dict[str, dict[str, int]] = {model: {} for model in models}
    for index, (model, cls) in enumerate((m, c) for m in models for c in classes):
        depths[model][cls] = int(replies[2 * index])
        heads += [(model, cls, job_id) for job_id in replies[2 * index + 1]]
    async with redis.pipeline(transaction=False) as pipe:
        for _model, _cls, job_id in heads:
            pipe.hmget(keys.job(job_id), ["created_at", "owner"])
        found = await pipe.execute()
    oldest: dict[str, float] = dict.fromkeys(models, 0.0)
    waiting: dict[str, Counter[str]] = {model: Counter() for model in models}
    for (model, cls, _job_id), (created, owner) in zip(heads, found, strict=True):
        if created is None:
            continue
        oldest[model] = max(oldest[model], now - float(created))
        waiting[model][f"{cls}:{owner or '-'}"] += 1
    return {
        model: QueueStats(sum(depths[model].values()), oldest[model], depths[model], dict(waiting[model]))
        for model in models
    }


_Summable = TypeVar("_Summable", QueueStats, RecentOutcomes, Counter[str])


def summed(per_store: list[dict[str, _Summable]]) -> dict[str, _Summable]:
    """Each model's figures from every Redis store that holds some of its jobs, added up."""
    total: dict[str, _Summable] = {}
    for figures in per_store:
        for model, value in figures.items():
            total[model] = total[model] + value if model in total else value
    return total


async def served_tokens(redis: Redis, keys: Keyspace, model: str) -> dict[str, int]:
    """Tokens served (prompt and generated) by the model's finished jobs: per class, and per
    "<class>:<key>"."""
    raw: dict[str, str] = await redis.hgetall(keys.served_tokens(model))  # type: ignore[misc]
    return {name: int(value) for name, value in raw.items()}


async def recent_outcomes(
    redis: Redis, keys: Keyspace, models: list[str], now: float | None = None
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


async def known_models(redis: Redis, keys: Keyspace) -> list[str]:
    """Every model a worker registered within the job TTL, sorted."""
    names: list[str] = await redis.hkeys(keys.models)  # type: ignore[misc]
    return sorted(names)
