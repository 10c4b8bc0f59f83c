"""Submitting a job (submit.lua): the queue's and the owner's limits, idempotency, replication."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from redis.asyncio import Redis

from common import lua
from common.events import status_entry
from common.jobs.payload import job_payload
from common.jobs.record import JobRecord
from common.keys import Keyspace
from common.wire import JobSpec, JobStatus


@dataclass(frozen=True)
class QueueLimits:
    max_jobs: int
    max_tokens: int  # prompt and generated tokens of the jobs waiting, estimated at submission
    max_wait_s: float  # a job still queued after this fails as expired; 0 waits forever


@dataclass(frozen=True)
class Submitted:
    job_id: str
    created: bool


class OwnerBusy(Exception):
    def __init__(self, owner: str, limit: int, stores: int = 1) -> None:
        if stores > 1:
            said = (
                f"key {owner!r} is at its limit of {limit} active jobs, shared over the model's {stores} "
                "Redis stores (each store holds its share, rounded up); wait for one to end"
            )
        else:
            said = f"key {owner!r} has {limit} active jobs, its limit; wait for one to end"
        super().__init__(said)
        self.owner = owner
        self.limit = limit


class PromptTokensBusy(Exception):
    """The key's active jobs hold prompt tokens such that this one's would pass its limit."""

    def __init__(self, owner: str, limit: int, holding: int, asked: int) -> None:
        super().__init__(
            f"key {owner!r} has {holding} prompt tokens in queued and running jobs; this job's {asked} "
            f"(estimated) would pass its limit of {limit}; wait for one to end"
        )
        self.owner = owner
        self.limit = limit
        self.holding = holding
        self.asked = asked


class StreamBytesBusy(Exception):
    """The key's active jobs would keep so many bytes of streams in Redis that this one's would pass its
    limit (logprobs make a token's entry about 30 times larger)."""

    def __init__(self, owner: str, limit: int, holding: int, asked: int) -> None:
        super().__init__(
            f"key {owner!r} has queued and running jobs whose streams keep about {holding} bytes in Redis; "
            f"this job's {asked} (estimated from max_tokens and logprobs) would pass its limit of {limit}; "
            "wait for one to end, or ask for fewer tokens or top logprobs"
        )
        self.owner = owner
        self.limit = limit
        self.holding = holding
        self.asked = asked


class NotReplicated(Exception):
    """Fewer replicas than asked confirmed a submission's writes: the job may exist (on the primary only)."""

    def __init__(self, job_id: str, confirmed: int, wanted: int) -> None:
        super().__init__(f"job {job_id}: {confirmed} of {wanted} replicas confirmed its submission")
        self.job_id = job_id
        self.confirmed = confirmed
        self.wanted = wanted


class EpochChanged(Exception):
    """The Redis's epoch is not the one the job id carries: it lost its data since the caller read its
    epoch (common/store_epoch.py). Nothing was written."""


class QueueFull(Exception):
    def __init__(self, model: str, limit: str) -> None:
        super().__init__(f"the queue of model {model!r} is full ({limit})")
        self.model = model
        self.limit = limit


class SubmitOutcome(str, Enum):
    """submit.lua's first reply."""

    created = "created"  # detail: the job id
    duplicate = "duplicate"  # its idempotency key names a job already: detail, that job's id
    busy = "busy"  # the owner has its most active jobs
    prompt_tokens = "prompt_tokens"  # the owner's active jobs hold too many prompt tokens: detail, how many
    stream_bytes = "stream_bytes"  # the owner's active jobs' streams keep too many bytes: detail, how many
    full = "full"  # the model's queue is at a limit: detail, 'jobs' or 'tokens'
    epoch = "epoch"  # the Redis's epoch is not the job id's


@dataclass(frozen=True)
class SubmitReply:
    outcome: SubmitOutcome
    detail: str
    confirmed: int  # replicas that confirmed the writes (0 when none were asked for)


class SubmitScript:
    """submit.lua, called with its job's values by name; waits for replicas when asked."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self._redis = redis
        self.keys = keys
        self._script = lua.register(redis, __name__, "submit.lua")

    async def __call__(
        self,
        *,
        record: JobRecord,
        event: dict[str, str],
        payload: str,
        ttl_s: int,
        now_ms: int,
        limits: QueueLimits,
        owner_max_active: int,
        prompt_tokens: int,
        owner_max_prompt_tokens: int,
        stream_bytes: int,
        owner_max_stream_bytes: int,
        epoch: str,
        replicas: int,
        replicas_timeout_ms: int,
    ) -> SubmitReply:
        job_id, model, owner, priority = record.id, record.model, record.owner, record.priority.value
        script_keys = [
            *self.keys.job_keys(job_id),
            self.keys.queue(model, priority),
            self.keys.queued_tokens(model),
            self.keys.active_jobs(owner),
            self.keys.owner_jobs(owner),
            self.keys.fair_tags(model, priority),
            self.keys.epoch,
            self.keys.queue_deadlines,
            self.keys.prompt_tokens_in_flight(owner),
            self.keys.owner_ended_jobs(owner),
            *([record.idempotency_key] if record.idempotency_key else []),
        ]
        args = [
            job_id,
            str(ttl_s),
            str(now_ms),
            str(limits.max_jobs),
            payload,
            self.keys.wake_channel(model),
            str(record.cost),
            str(limits.max_tokens),
            str(owner_max_active),
            owner,
            repr(float(record.weight)),
            str(prompt_tokens),
            str(owner_max_prompt_tokens),
            str(stream_bytes),
            str(owner_max_stream_bytes),
            *lua.flat_fields(record.to_fields()),
            *lua.flat_fields(event),
            str(record.deadline_ms) if record.deadline_ms else "",
            epoch,
        ]
        if replicas <= 0:
            outcome, detail = await self._script(keys=script_keys, args=args)
            confirmed = 0
        else:
            async with self._redis.pipeline(transaction=False) as pipe:
                await self._script(keys=script_keys, args=args, client=pipe)
                pipe.wait(replicas, replicas_timeout_ms)
                (outcome, detail), confirmed = await pipe.execute()
        return SubmitReply(SubmitOutcome(outcome), detail, int(confirmed))


class JobSubmission:
    """JobQueue's submit."""

    keys: Keyspace
    ttl_s: int
    _submit: SubmitScript

    async def submit(
        self,
        spec: JobSpec,
        *,
        limits: QueueLimits,
        cost: int,
        kv_tokens: int | None = None,
        idempotency_key: str | None = None,
        owner: str = "",
        owner_max_active: int = 0,
        weight: float = 1.0,
        prompt_tokens: int = 0,
        owner_max_prompt_tokens: int = 0,
        stream_bytes: int = 0,
        owner_max_stream_bytes: int = 0,
        request_digest: str | None = None,
        replicas: int = 0,
        replicas_timeout_ms: int = 1000,
        epoch: str = "",
        preferred_worker: str | None = None,
        preferred_until_ms: int | None = None,
    ) -> Submitted:
        """Queue a job atomically; raises QueueFull when the model's queue is at one of its limits, OwnerBusy
        PromptTokensBusy or StreamBytesBusy when its owner is at one of its own (`prompt_tokens`, the job's
        estimated prompt, counts against `owner_max_prompt_tokens` until the job ends, and `stream_bytes`,
        what its stream will keep in Redis, against `owner_max_stream_bytes`; `kv_tokens`, the KV it needs, is
        compared with each worker's budget when it claims). With
        `replicas`, returns only once that many replicas confirm the writes (WAIT on the connection that
        ran the script), else raises NotReplicated. With `epoch` (the one the job id carries), raises
        EpochChanged when the Redis's is another."""
        now_ms = int(spec.submitted_at * 1000)
        record = JobRecord(
            id=spec.id,
            model=spec.model,
            status=JobStatus.queued,
            created_at=spec.submitted_at,
            owner=owner,
            cost=cost,
            kv_tokens=kv_tokens,
            idempotency_key=idempotency_key,
            request_digest=request_digest,
            deadline_ms=now_ms + int(limits.max_wait_s * 1000) if limits.max_wait_s else None,
            priority=spec.priority,
            weight=weight,
            preferred_worker=preferred_worker,
            preferred_until_ms=preferred_until_ms,
            adapter=spec.adapter,
        )
        reply = await self._submit(
            record=record,
            event=status_entry(JobStatus.queued),
            payload=job_payload(spec, now_ms).decode(),
            ttl_s=self.ttl_s,
            now_ms=now_ms,
            limits=limits,
            owner_max_active=owner_max_active,
            prompt_tokens=prompt_tokens,
            owner_max_prompt_tokens=owner_max_prompt_tokens,
            stream_bytes=stream_bytes,
            owner_max_stream_bytes=owner_max_stream_bytes,
            epoch=epoch,
            replicas=replicas,
            replicas_timeout_ms=replicas_timeout_ms,
        )
        if reply.outcome is SubmitOutcome.epoch:
            raise EpochChanged(f"the Redis of model {spec.model!r} lost its data")
        if reply.outcome is SubmitOutcome.busy:
            raise OwnerBusy(owner, owner_max_active)
        if reply.outcome is SubmitOutcome.prompt_tokens:
            raise PromptTokensBusy(owner, owner_max_prompt_tokens, int(reply.detail), prompt_tokens)
        if reply.outcome is SubmitOutcome.stream_bytes:
            raise StreamBytesBusy(owner, owner_max_stream_bytes, int(reply.detail), stream_bytes)
        if reply.outcome is SubmitOutcome.full:
            jobs = reply.detail == "jobs"
            raise QueueFull(
                spec.model, f"{limits.max_jobs} jobs" if jobs else f"{limits.max_tokens} queued tokens"
            )
        if reply.confirmed < replicas:
            raise NotReplicated(reply.detail, reply.confirmed, replicas)
        return Submitted(job_id=reply.detail, created=reply.outcome is SubmitOutcome.created)
