"""Jobs put straight on a JobQueue (no gateway) with a priority class, an owner, a weight and a token
cost, under a model name of the test's own."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from common.jobs.queue import JobQueue
from common.jobs.submission import QueueLimits
from common.wire import JobSpec, PriorityClass, Sampling
from tests.conftest import keys

NO_LIMITS = QueueLimits(10_000, 10**9, 0)
OWNERS = ("team", "flood", "light", "heavy", "long", "short", "busy", "idle", "thrifty", "late", "other")
OWNERS += ("alice", "bob")


@pytest.fixture
async def model(redis: Redis) -> AsyncIterator[str]:
    """A model name of the test's own; its queues and leases (kept without a TTL) go at the end."""
    name = f"sched-{uuid.uuid4().hex[:8]}"
    yield name
    queues = [keys.queue(name, cls.value) for cls in PriorityClass]
    await redis.delete(*queues, keys.leases(name))
    # The owners' active jobs are Redis-wide: jobs left queued here must not count against the
    # API keys of the same names in other tests.
    await redis.delete(*(keys.active_jobs(owner) for owner in OWNERS))
    await redis.delete(*(keys.owner_jobs(owner) for owner in OWNERS))


async def submit(
    queue: JobQueue,
    model: str,
    *,
    owner: str = "team",
    priority: PriorityClass = PriorityClass.interactive,
    weight: float = 1.0,
    cost: int = 10,
    prompt: str = "Hello",
    max_tokens: int = 4,
) -> str:
    spec = JobSpec(
        id=f"job_{uuid.uuid4().hex}",
        model=model,
        prompt=prompt,
        sampling=Sampling(max_tokens=max_tokens),
        submitted_at=time.time(),
        priority=priority,
    )
    await queue.submit(spec, limits=NO_LIMITS, cost=cost, owner=owner, weight=weight)
    return spec.id
