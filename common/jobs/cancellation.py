"""Ending a job that no worker runs: a cancel (cancel.lua), a purge (purge.lua), and the gateways' sweep
of queue deadlines (expire_queued.lua)."""

from __future__ import annotations

import logging
import time
from enum import Enum

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common import lua
from common.error_codes import ErrorCode
from common.events import done_entry
from common.fleet_stats import RECENT_WINDOW_S
from common.jobs.record import JobRecord, load_record
from common.keys import Keyspace
from common.wire import FinishReason, JobStatus, PriorityClass

logger = logging.getLogger(__name__)

_WINDOW_MS = str(RECENT_WINDOW_S * 1000)


class CancelOutcome(str, Enum):
    """What a cancel did (cancel.lua's reply), or else the status the job had, left as it was."""

    cancelled = "cancelled"  # it was queued and never runs (or it had been cancelled before)
    cancelling = "cancelling"  # it runs: its worker is told to stop
    missing = "missing"
    queued = "queued"  # queued, yet in no queue: a worker holds it between a claim and its start
    running = "running"
    succeeded = "succeeded"
    failed = "failed"


class CancelScript:
    """cancel.lua."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "cancel.lua")

    async def __call__(self, *, record: JobRecord, model: str, now: float, ttl_s: int) -> CancelOutcome:
        job_id = record.id
        done = done_entry(JobStatus.cancelled, FinishReason.cancelled.value, None)
        reply: str = await self._script(
            keys=[
                self.keys.job(job_id),
                self.keys.queue(model, record.priority.value),
                self.keys.events(job_id),
                self.keys.arq_job(job_id),
                self.keys.queued_tokens(model),
                self.keys.active_jobs(record.owner),
                self.keys.finished(model),
                self.keys.prompt_tokens_in_flight(record.owner),
                self.keys.owner_jobs(record.owner),
                self.keys.owner_ended_jobs(record.owner),
                *([record.idempotency_key] if record.idempotency_key else []),
            ],
            args=[
                job_id,
                str(now),
                self.keys.cancel_channel,
                str(int(now * 1000)),
                _WINDOW_MS,
                str(ttl_s),
                *lua.flat_fields(done),
                self.keys.stream_notices,
            ],
        )
        return CancelOutcome(reply)


class PurgeScript:
    """purge.lua: True, or False when the job did not exist."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "purge.lua")

    async def __call__(self, *, record: JobRecord, model: str) -> bool:
        job_id = record.id
        purged: int = await self._script(
            keys=[
                *self.keys.job_keys(job_id),
                self.keys.queue(model, record.priority.value),
                self.keys.leases(model),
                self.keys.queued_tokens(model),
                self.keys.active_jobs(record.owner),
                self.keys.owner_jobs(record.owner),
                self.keys.prompt_tokens_in_flight(record.owner),
                self.keys.owner_ended_jobs(record.owner),
                *([record.idempotency_key] if record.idempotency_key else []),
            ],
            args=[job_id, self.keys.cancel_channel],
        )
        return bool(purged)


class ExpireQueuedScript:
    """expire_queued.lua: True when it failed the job as expired in its queue."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "expire_queued.lua")

    async def __call__(
        self,
        *,
        job_id: str,
        model: str,
        priority: str,
        owner: str,
        idempotency_key: str | None,
        now_ms: int,
        ttl_s: int,
    ) -> bool:
        expired: int = await self._script(
            keys=[
                self.keys.queue_deadlines,
                self.keys.queued_tokens(model),
                self.keys.finished(model),
                self.keys.queue(model, priority),
                *self.keys.job_keys(job_id),
                self.keys.active_jobs(owner),
                self.keys.prompt_tokens_in_flight(owner),
                self.keys.owner_jobs(owner),
                self.keys.owner_ended_jobs(owner),
                *([idempotency_key] if idempotency_key else []),
            ],
            args=[
                job_id,
                str(now_ms),
                _WINDOW_MS,
                ErrorCode.expired_in_queue.value,
                owner,
                str(ttl_s),
                self.keys.stream_notices,
            ],
        )
        return bool(expired)


class JobCancellation:
    """JobQueue's cancel, purge and queue-deadline sweep."""

    keys: Keyspace
    _redis: Redis
    ttl_s: int
    _cancel: CancelScript
    _purge: PurgeScript
    _expire_queued: ExpireQueuedScript

    async def cancel(self, job_id: str, model: str) -> CancelOutcome:
        """`cancelled` (was queued), `cancelling` (running, worker told), `missing`, or the job's status."""
        record = await load_record(self._redis, job_id, self.keys)
        if record is None:
            return CancelOutcome.missing
        return await self._cancel(record=record, model=model, now=time.time(), ttl_s=self.ttl_s)

    async def purge(self, job_id: str, model: str) -> bool:
        """Delete every trace of the job now; a running job is told to stop and can write nothing more."""
        record = await load_record(self._redis, job_id, self.keys)
        if record is None:
            return False
        return await self._purge(record=record, model=model)

    async def expire_overdue(self, now_ms: int, most: int = 100) -> int:
        """Fails the jobs still waiting for a first attempt past their queue deadline, as a claim would,
        whether or not a worker of their model is live (up to `most` a call); how many it failed."""
        due: list[str] = await self._redis.zrangebyscore(self.keys.queue_deadlines, "-inf", now_ms, 0, most)
        expired = 0
        for job_id in due:
            try:
                expired += await self._expire_one(job_id, now_ms)
            except ResponseError as e:  # this job's keys, not Redis: the others expire all the same
                logger.warning("job %s: cannot expire it in the queue (%s); the sweep goes on", job_id, e)
        return expired

    async def _expire_one(self, job_id: str, now_ms: int) -> int:
        fields = ["model", "priority", "owner", "idempotency_key"]
        model, priority, owner, idem = await self._redis.hmget(self.keys.job(job_id), fields)  # type: ignore[misc]
        if model is None:  # expired or purged meanwhile
            await self._redis.zrem(self.keys.queue_deadlines, job_id)
            return 0
        expired: bool = await self._expire_queued(
            job_id=job_id,
            model=model,
            priority=priority or PriorityClass.interactive.value,
            owner=owner or "",
            idempotency_key=idem or None,
            now_ms=now_ms,
            ttl_s=self.ttl_s,
        )
        return int(expired)
