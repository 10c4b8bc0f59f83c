"""Reads of jobs and queues that change nothing, and the writes that stage jobs for tests and benches."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from common.events import status_entry
from common.jobs.record import JobRecord, load_record
from common.keys import Keyspace
from common.wire import PRIORITY_ORDER, PriorityClass


@dataclass(frozen=True)
class AttemptStart:
    """What a worker reads of a job's record as an attempt starts (a few fields, not the whole record)."""

    cancel_requested: bool
    preemptions: int
    weight: float  # its owner's weight when it was submitted
    first_token_at: float | None


_ATTEMPT_START_FIELDS = ["id", "cancel_requested", "preemptions", "weight", "first_token_at"]


@dataclass(frozen=True)
class QueueAhead:
    """What waits before a queued job: in higher classes, and before it in its own class's queue."""

    jobs: int
    tokens: float  # their estimated tokens (prompt and max_tokens); past the scan, at the mean of those read
    typical: float  # the mean estimate of the jobs read at the heads of the model's queues


@dataclass(frozen=True)
class WaitingJob:
    """A job waiting in a class's queue, as a worker weighing keys' shares of its rows reads it."""

    id: str
    owner: str
    weight: float  # its owner's weight when it was submitted


class JobReads:
    """JobQueue's reads."""

    keys: Keyspace
    _redis: Redis

    async def record(self, job_id: str) -> JobRecord | None:
        return await load_record(self._redis, job_id, self.keys)

    async def attempt_start(self, job_id: str) -> AttemptStart | None:
        """The record's fields an attempt starts from (None when the record is gone)."""
        found, cancel, preemptions, weight, first = await self._redis.hmget(  # type: ignore[misc]
            self.keys.job(job_id), _ATTEMPT_START_FIELDS
        )
        if found is None:
            return None
        return AttemptStart(
            cancel_requested=cancel == "1",
            preemptions=int(preemptions or 0),
            weight=float(weight or 1.0),
            first_token_at=float(first) if first else None,
        )

    async def owned_record(self, job_id: str, owner: str) -> JobRecord | None:
        """The job's record if `owner` owns it. The owner's index and the record are read in one round
        trip whatever they hold, so another owner's job and a missing one take the same path and cannot be
        told apart."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zscore(self.keys.owner_jobs(owner), job_id)
            pipe.hgetall(self.keys.job(job_id))
            listed, raw = await pipe.execute()
        if listed is None or not raw:
            return None
        record = JobRecord.from_fields(raw)
        return record if record.owner == owner else None

    async def queue_position(
        self, model: str, job_id: str, priority: PriorityClass = PriorityClass.interactive
    ) -> int | None:
        """Jobs ahead of this one: those waiting in higher classes and before it in its own class's
        queue; None when it is not queued."""
        higher = PRIORITY_ORDER[: PRIORITY_ORDER.index(priority)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for cls in higher:
                pipe.zcard(self.keys.queue(model, cls.value))
            pipe.zrank(self.keys.queue(model, priority.value), job_id)
            *ahead, rank = await pipe.execute()
        return None if rank is None else int(rank) + sum(int(n) for n in ahead)

    async def queue_ahead(
        self, model: str, job_id: str, priority: PriorityClass = PriorityClass.interactive, scan: int = 128
    ) -> QueueAhead | None:
        """The jobs ahead of this one and their estimated tokens, read for up to `scan` jobs at the head of
        each class's queue; None when it is not queued."""
        own = PRIORITY_ORDER.index(priority)
        async with self._redis.pipeline(transaction=False) as pipe:
            for cls in PRIORITY_ORDER:
                pipe.zcard(self.keys.queue(model, cls.value))
                pipe.zrange(self.keys.queue(model, cls.value), 0, scan - 1)
            pipe.zrank(self.keys.queue(model, priority.value), job_id)
            *replies, rank = await pipe.execute()
        if rank is None:
            return None
        counts = [int(n) for n in replies[0::2]]
        counts[own] = int(rank)  # its own class: only those before it
        counts[own + 1 :] = [0] * (len(counts) - own - 1)
        heads: list[list[str]] = [list(ids) for ids in replies[1::2]]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job in (job for head in heads for job in head):
                pipe.hget(self.keys.job(job), "cost")
            costs = [int(cost or 0) for cost in await pipe.execute()]
        tokens = 0.0
        at = 0
        for count, head in zip(counts, heads, strict=True):
            before = costs[at : at + min(count, len(head))]
            tokens += sum(before) * count / len(before) if before else 0.0
            at += len(head)
        return QueueAhead(sum(counts), tokens, sum(costs) / max(len(costs), 1))

    async def waiting_jobs(self, model: str, cls: PriorityClass, scan: int) -> list[WaitingJob]:
        """Up to `scan` jobs at the head of the class's queue, in queue order, with their owners."""
        ids: list[str] = await self._redis.zrange(self.keys.queue(model, cls.value), 0, scan - 1)
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(self.keys.job(job_id), ["status", "owner", "weight"])
            fields = await pipe.execute()
        return [
            WaitingJob(job_id, owner or "", float(weight or 1.0))
            for job_id, (status, owner, weight) in zip(ids, fields, strict=True)
            if status is not None  # purged meanwhile
        ]

    async def waiting(self, model: str) -> dict[PriorityClass, int]:
        """Jobs waiting in each class's queue of the model."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for cls in PRIORITY_ORDER:
                pipe.zcard(self.keys.queue(model, cls.value))
            counts = await pipe.execute()
        return {cls: int(n) for cls, n in zip(PRIORITY_ORDER, counts, strict=True)}

    async def entries(self, job_id: str) -> list[dict[str, str]]:
        """Every entry of the job's stream so far, oldest first."""
        return [fields for _entry_id, fields in await self._redis.xrange(self.keys.events(job_id))]

    async def streamed(self, job_id: str) -> int:
        """Where the tokens in the job's stream end: the index the next token entry should have."""
        value = await self._redis.hget(self.keys.job(job_id), "streamed")  # type: ignore[misc]
        return int(value or 0)


async def stage_jobs(redis: Redis, keys: Keyspace, records: list[JobRecord], ttl_s: int = 600) -> None:
    """Writes job records in a given state, with their owner's index entry and a first status event,
    as if they had been submitted and reached that state: for benchmarks and tests that need many jobs
    at a point of their life without running a model. Nothing is queued."""
    async with redis.pipeline(transaction=False) as pipe:
        for record in records:
            pipe.hset(keys.job(record.id), mapping=record.to_fields())
            pipe.expire(keys.job(record.id), ttl_s)
            pipe.zadd(keys.owner_jobs(record.owner), {record.id: int(record.created_at * 1000)})
            pipe.expire(keys.owner_jobs(record.owner), ttl_s, nx=True)  # the index outlives each job in it
            pipe.expire(keys.owner_jobs(record.owner), ttl_s, gt=True)
            entry = status_entry(record.status, attempt=record.attempts or None)
            pipe.xadd(keys.events(record.id), entry)  # type: ignore[arg-type]
            pipe.expire(keys.events(record.id), ttl_s)
        notice_streams(pipe, keys, [keys.events(record.id) for record in records])
        await pipe.execute()


def notice_streams(pipe: Pipeline, keys: Keyspace, streams: list[str]) -> None:
    """Tells the gateways' relays that these job streams have new entries, as the job scripts do, for
    writers that add entries themselves (benchmarks' synthetic publishers, tests)."""
    if streams:
        command = "SPUBLISH" if keys.tag is not None else "PUBLISH"  # as common/jobs/scripts/notice.lua
        pipe.execute_command(command, keys.stream_notices, " ".join(dict.fromkeys(streams)))
