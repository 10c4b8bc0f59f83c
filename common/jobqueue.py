"""The job state machine in Redis: every transition is one JobQueue method and one atomic Lua script.

A model has one queue per priority class (common.wire.PRIORITY_ORDER): a sorted set of job ids scored
by a fair-share tag (start-time fair queuing by tokens between keys, weighted per key; see
job_scripts._FAIR). A worker claims from the highest class with waiting jobs, moving the job to the
model's lease set, scored by the lease's expiry; its heartbeat pushes that expiry forward. A lease
that runs out (the worker died) puts the job back in its queue with its tag, where any worker of the
model resumes it; so does a batch job preempted for interactive work. Writes to a job's stream and
record are fenced by the attempt number, so a worker that lost its lease can never write into the job
again.
The scripts (common/job_scripts.py) receive every key they touch in KEYS, derived in common/keys.py;
the record's fields and their encoding are common/records.py's. The job itself is stored in arq's
format (``arq:job:<id>``, JSON-serialized).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from arq.jobs import deserialize_job_raw, serialize_job
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from common import job_scripts, keys
from common.error_codes import ErrorCode
from common.events import TOKEN, done_entry, entry_token_ids, error_entry, status_entry
from common.fleet_stats import RECENT_WINDOW_S
from common.prefix_hints import leave_hints
from common.records import JobRecord, RecordUpdate, load_record
from common.redis_client import HeldConnection
from common.wire import PRIORITY_ORDER, ChatMessage, FinishReason, JobSpec, JobStatus, PriorityClass

GENERATE = "generate"

# A claim looks at the queue again, up to this many times in all, when the claim script stops early:
# the head of the queue moved, or a job expired whose owner the claim did not look up (it looks up
# owners only then, since only an expired job's owner has keys to change).
_CLAIM_ROUNDS = 4
_HEAD_MOVED = 1
_OWNERS_NEEDED = 2
_PREFERRED_ELSEWHERE = 3  # the head waits, for a little while, for the worker that holds its prompt's KV
_EXPIRED = ErrorCode.expired_in_queue.value


def _flat(fields: dict[str, str]) -> list[str]:
    out: list[str] = [str(len(fields))]
    for key, value in fields.items():
        out += [key, value]
    return out


def job_payload(spec: JobSpec, enqueue_ms: int) -> bytes:
    payload: bytes = serialize_job(
        GENERATE, (), {"spec": spec.model_dump(mode="json")}, None, enqueue_ms, serializer=_json_bytes
    )
    return payload


def _json_bytes(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def claim_priority(claim: Claim) -> PriorityClass:
    """The class of a claimed job, from its payload (interactive when unreadable)."""
    try:
        return parse_job_payload(claim.payload).priority
    except MalformedJob:
        return PriorityClass.interactive


class MalformedJob(ValueError):
    """A job found in Redis that is not one ortfleet wrote (truncated, foreign or pickled)."""


def parse_job_payload(payload: str) -> JobSpec:
    try:
        function, _args, kwargs, _tries, _enqueued = deserialize_job_raw(
            payload.encode(), deserializer=json.loads
        )
        if function != GENERATE:
            raise ValueError(f"unknown job function {function!r}")
        return JobSpec.model_validate(kwargs["spec"])
    except Exception as e:
        raise MalformedJob(f"malformed job payload: {e}") from e


@dataclass(slots=True)
class StepWrite:
    """One job's share of a worker's write for an engine step."""

    job_id: str
    attempt: int
    entries: list[dict[str, str]]
    record: dict[str, str]  # RecordUpdate.to_fields()
    check_gap: bool = True  # refuse it when the stream's tokens end before its first token entry
    span: tuple[int, int] | None = field(init=False)  # its token entries' span (see token_span)

    def __post_init__(self) -> None:
        self.span = token_span(self.entries)


class StepResult(IntEnum):
    """What became of one job's share of a step write (truthy while the attempt owns the job)."""

    lost = 0  # another attempt owns the job: nothing written
    written = 1
    gap = 2  # nothing written: the stream lacks tokens the attempt wrote before (lost in a failover)


class StreamGap(Exception):
    """The job's stream holds fewer tokens than the attempt wrote: they must be written again first."""


def token_span(entries: list[dict[str, str]]) -> tuple[int, int] | None:
    """The token index of the first token entry among `entries`, and the index past the last one."""
    tokens = [entry for entry in entries if entry.get("type") == TOKEN and "index" in entry]
    if not tokens:
        return None
    last = tokens[-1]
    return int(tokens[0]["index"]), int(last["index"]) + len(entry_token_ids(last))


@dataclass(frozen=True)
class Claim:
    """A job a worker claimed: its writes into the job carry `attempt`."""

    job_id: str
    attempt: int
    payload: str  # the job in arq's format
    model: str
    owner: str
    quarantined: bool = False  # a suspect job's attempt: it runs alone, its worker takes nothing else
    quarantine_deaths: int = 0  # workers that died running it in quarantine, before this attempt


@dataclass(frozen=True)
class Claimed:
    claims: list[Claim]
    suspect_waiting: bool  # a suspect job waits for a worker that runs nothing else


class OwnerBusy(Exception):
    def __init__(self, owner: str, limit: int) -> None:
        super().__init__(f"key {owner!r} has {limit} active jobs, its limit; wait for one to end")
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


@dataclass(frozen=True)
class QueueLimits:
    max_jobs: int
    max_tokens: int  # prompt and generated tokens of the jobs waiting, estimated at submission
    max_wait_s: float  # a job still queued after this fails as expired; 0 waits forever


@dataclass(frozen=True)
class QueueAhead:
    """What waits before a queued job: in higher classes, and before it in its own class's queue."""

    jobs: int
    tokens: float  # their estimated tokens (prompt and max_tokens); past the scan, at the mean of those read
    typical: float  # the mean estimate of the jobs read at the heads of the model's queues


@dataclass(frozen=True)
class Submitted:
    job_id: str
    created: bool


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


class JobQueue:
    """Atomic job transitions shared by the gateway (submit, cancel, purge) and workers (claim ... finish).

    Its Redis client is its own: callers read and change jobs through its methods only.
    """

    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self._redis = redis
        self.ttl_s = ttl_s
        self._submit = redis.register_script(job_scripts.SUBMIT)
        self._cancel = redis.register_script(job_scripts.CANCEL)
        self._claim = redis.register_script(job_scripts.CLAIM)
        self._expire_queued = redis.register_script(job_scripts.EXPIRE_QUEUED)
        self._renew = redis.register_script(job_scripts.RENEW)
        self._publish = redis.register_script(job_scripts.PUBLISH)
        self._publish_step = redis.register_script(job_scripts.PUBLISH_STEP)
        self._step_writes = HeldConnection(redis)  # one script call per engine step, one after another
        self._finish = redis.register_script(job_scripts.FINISH)
        self._release = redis.register_script(job_scripts.RELEASE)
        self._purge = redis.register_script(job_scripts.PURGE)
        self._reserve_preemption = redis.register_script(job_scripts.RESERVE_PREEMPTION)

    async def record(self, job_id: str) -> JobRecord | None:
        return await load_record(self._redis, job_id)

    async def owned_record(self, job_id: str, owner: str) -> JobRecord | None:
        """The job's record if `owner` owns it. The owner's index is asked first, so another owner's job
        and a missing one take the same path (one lookup that finds nothing) and cannot be told apart."""
        if await self._redis.zscore(keys.owner_jobs(owner), job_id) is None:
            return None
        record = await load_record(self._redis, job_id)
        return record if record is not None and record.owner == owner else None

    async def queue_position(
        self, model: str, job_id: str, priority: PriorityClass = PriorityClass.interactive
    ) -> int | None:
        """Jobs ahead of this one: those waiting in higher classes and before it in its own class's
        queue; None when it is not queued."""
        higher = PRIORITY_ORDER[: PRIORITY_ORDER.index(priority)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for cls in higher:
                pipe.zcard(keys.queue(model, cls.value))
            pipe.zrank(keys.queue(model, priority.value), job_id)
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
                pipe.zcard(keys.queue(model, cls.value))
                pipe.zrange(keys.queue(model, cls.value), 0, scan - 1)
            pipe.zrank(keys.queue(model, priority.value), job_id)
            *replies, rank = await pipe.execute()
        if rank is None:
            return None
        counts = [int(n) for n in replies[0::2]]
        counts[own] = int(rank)  # its own class: only those before it
        counts[own + 1 :] = [0] * (len(counts) - own - 1)
        heads: list[list[str]] = [list(ids) for ids in replies[1::2]]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job in (job for head in heads for job in head):
                pipe.hget(keys.job(job), "cost")
            costs = [int(cost or 0) for cost in await pipe.execute()]
        tokens = 0.0
        at = 0
        for count, head in zip(counts, heads, strict=True):
            before = costs[at : at + min(count, len(head))]
            tokens += sum(before) * count / len(before) if before else 0.0
            at += len(head)
        return QueueAhead(sum(counts), tokens, sum(costs) / max(len(costs), 1))

    async def reserve_preemption(self, model: str, slots: int, waiting: int, hold_s: float) -> bool:
        """Whether a worker may free `slots` for the `waiting` interactive jobs: False when the slots
        other workers are freeing cover them already. Reservations lapse after `hold_s`."""
        reserved: int = await self._reserve_preemption(
            keys=[keys.preempting(model)], args=[str(slots), str(waiting), str(int(hold_s * 1000))]
        )
        return bool(reserved)

    async def end_preemption(self, model: str, hold_s: float) -> None:
        """One reserved slot is free: its job is back in the queue, or ended before it stopped."""
        await self._reserve_preemption(
            keys=[keys.preempting(model)], args=["-1", "0", str(int(hold_s * 1000))]
        )

    async def head_owner(self, model: str, cls: PriorityClass) -> str | None:
        """The owner of the job at the head of the class's queue (the next to be claimed); None when the
        queue is empty."""
        head = await self._redis.zrange(keys.queue(model, cls.value), 0, 0)
        if not head:
            return None
        owner: str | None = await self._redis.hget(keys.job(head[0]), "owner")  # type: ignore[misc]
        return owner if owner is not None else ""

    async def waiting(self, model: str) -> dict[PriorityClass, int]:
        """Jobs waiting in each class's queue of the model."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for cls in PRIORITY_ORDER:
                pipe.zcard(keys.queue(model, cls.value))
            counts = await pipe.execute()
        return {cls: int(n) for cls, n in zip(PRIORITY_ORDER, counts, strict=True)}

    async def entries(self, job_id: str) -> list[dict[str, str]]:
        """Every entry of the job's stream so far, oldest first."""
        return [fields for _entry_id, fields in await self._redis.xrange(keys.events(job_id))]

    async def submit(
        self,
        spec: JobSpec,
        *,
        limits: QueueLimits,
        cost: int,
        idempotency_key: str | None = None,
        owner: str = "",
        owner_max_active: int = 0,
        weight: float = 1.0,
        prompt_tokens: int = 0,
        owner_max_prompt_tokens: int = 0,
        request_digest: str | None = None,
        replicas: int = 0,
        replicas_timeout_ms: int = 1000,
        epoch: str = "",
        preferred_worker: str | None = None,
        preferred_until_ms: int | None = None,
    ) -> Submitted:
        """Queue a job atomically; raises QueueFull when the model's queue is at one of its limits, OwnerBusy
        or PromptTokensBusy when its owner is at one of its own (`prompt_tokens`, the job's estimated
        prompt, counts against `owner_max_prompt_tokens` until the job ends). With
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
            idempotency_key=idempotency_key,
            request_digest=request_digest,
            deadline_ms=now_ms + int(limits.max_wait_s * 1000) if limits.max_wait_s else None,
            priority=spec.priority,
            weight=weight,
            preferred_worker=preferred_worker,
            preferred_until_ms=preferred_until_ms,
        )
        args = [
            spec.id,
            str(self.ttl_s),
            str(now_ms),
            str(limits.max_jobs),
            job_payload(spec, now_ms).decode(),
            keys.wake_channel(spec.model),
            str(cost),
            str(limits.max_tokens),
            str(owner_max_active),
            owner,
            repr(float(weight)),
            str(prompt_tokens),
            str(owner_max_prompt_tokens),
            *_flat(record.to_fields()),
            *_flat(status_entry(JobStatus.queued)),
            str(record.deadline_ms) if record.deadline_ms else "",
            epoch,
        ]
        script_keys = [
            *keys.job_keys(spec.id),
            keys.queue(spec.model, spec.priority.value),
            keys.queued_tokens(spec.model),
            keys.active_jobs(owner),
            keys.owner_jobs(owner),
            keys.fair_tags(spec.model, spec.priority.value),
            keys.EPOCH,
            keys.QUEUE_DEADLINES,
            keys.prompt_tokens_in_flight(owner),
            *([idempotency_key] if idempotency_key else []),
        ]
        if replicas <= 0:
            outcome, detail = await self._submit(keys=script_keys, args=args)
            confirmed = 0
        else:
            async with self._redis.pipeline(transaction=False) as pipe:
                await self._submit(keys=script_keys, args=args, client=pipe)
                pipe.wait(replicas, replicas_timeout_ms)
                (outcome, detail), confirmed = await pipe.execute()
        if outcome == "epoch":
            raise EpochChanged(f"the Redis of model {spec.model!r} lost its data")
        if outcome == "busy":
            raise OwnerBusy(owner, owner_max_active)
        if outcome == "prompt_tokens":
            raise PromptTokensBusy(owner, owner_max_prompt_tokens, int(detail), prompt_tokens)
        if outcome == "full":
            limit = f"{limits.max_jobs} jobs" if detail == "jobs" else f"{limits.max_tokens} queued tokens"
            raise QueueFull(spec.model, limit)
        job_id = detail
        if confirmed < replicas:
            raise NotReplicated(job_id, int(confirmed), replicas)
        return Submitted(job_id=job_id, created=outcome == "created")

    async def cancel(self, job_id: str, model: str) -> str:
        """'cancelled' (was queued), 'cancelling' (running, worker told), 'missing', or a terminal status."""
        record = await self.record(job_id)
        if record is None:
            return "missing"
        now = time.time()
        done = done_entry(JobStatus.cancelled, FinishReason.cancelled.value, None)
        result: str = await self._cancel(
            keys=[
                keys.job(job_id),
                keys.queue(model, record.priority.value),
                keys.events(job_id),
                keys.arq_job(job_id),
                keys.queued_tokens(model),
                keys.active_jobs(record.owner),
                keys.finished(model),
                keys.prompt_tokens_in_flight(record.owner),
            ],
            args=[
                job_id,
                str(now),
                keys.CANCEL_CHANNEL,
                str(int(now * 1000)),
                str(RECENT_WINDOW_S * 1000),
                *_flat(done),
                keys.STREAM_NOTICES,
            ],
        )
        return result

    async def purge(self, job_id: str, model: str) -> bool:
        """Delete every trace of the job now; a running job is told to stop and can write nothing more."""
        record = await self.record(job_id)
        if record is None:
            return False
        purged: int = await self._purge(
            keys=[
                *keys.job_keys(job_id),
                keys.queue(model, record.priority.value),
                keys.leases(model),
                keys.queued_tokens(model),
                keys.active_jobs(record.owner),
                keys.owner_jobs(record.owner),
                keys.prompt_tokens_in_flight(record.owner),
                *([record.idempotency_key] if record.idempotency_key else []),
            ],
            args=[job_id, keys.CANCEL_CHANNEL],
        )
        return bool(purged)

    async def claim(
        self, model: str, worker_id: str, max_jobs: int, lease_s: float, *, idle: bool = True
    ) -> list[Claim]:
        """Up to `max_jobs` jobs from the heads of the model's queues, highest class first (jobs whose
        lease ran out go back to their queue first)."""
        return (await self.claim_jobs(model, worker_id, max_jobs, lease_s, idle=idle)).claims

    async def claim_jobs(
        self, model: str, worker_id: str, max_jobs: int, lease_s: float, *, idle: bool = True
    ) -> Claimed:
        """Up to `max_jobs` jobs from the heads of the model's queues, highest class first (jobs whose
        lease ran out go back to their queue first). A suspect job (a worker died holding it) is taken
        only by an `idle` worker (it runs nothing), as the claim's only job; a claim stops at a suspect
        job it may not take, and says one waits."""
        claims: list[Claim] = []
        suspect_waiting = False
        owners_needed = False
        for _ in range(_CLAIM_ROUNDS):
            wanted = max_jobs - len(claims)
            if wanted <= 0:
                break
            now_ms = int(time.time() * 1000)
            ids = await self._claim_candidates(model, wanted, now_ms)
            if not ids:
                break
            owners = await self._owners(ids) if owners_needed else {}
            script_keys = [
                keys.leases(model),
                keys.queued_tokens(model),
                keys.finished(model),
                keys.QUEUE_DEADLINES,
            ]
            for cls in PRIORITY_ORDER:
                script_keys += [keys.queue(model, cls.value), keys.fair_tags(model, cls.value)]
            window_ms = RECENT_WINDOW_S * 1000
            args = [str(now_ms), str(int(lease_s * 1000)), str(wanted), worker_id, str(window_ms), _EXPIRED]
            args.append("1" if idle and not claims else "0")
            args += [str(len(PRIORITY_ORDER)), *(cls.value for cls in PRIORITY_ORDER), keys.STREAM_NOTICES]
            for job_id in ids:
                owner = owners.get(job_id)
                script_keys += [
                    *keys.job_keys(job_id),
                    keys.active_jobs(owner or ""),
                    keys.prompt_tokens_in_flight(owner or ""),
                ]
                args += [job_id, owner or "", "1" if owner is not None else "0"]
            raw = await self._claim(keys=script_keys, args=args)
            taken = [
                Claim(
                    raw[i], int(raw[i + 1]), raw[i + 2], model, raw[i + 3], raw[i + 4] == "1", int(raw[i + 5])
                )
                for i in range(2, len(raw), 6)
            ]
            claims += taken
            suspect_waiting = raw[1] == "1"
            stopped = int(raw[0])
            if stopped == _PREFERRED_ELSEWHERE:
                break
            if stopped == _OWNERS_NEEDED:
                owners_needed = True
            elif stopped != _HEAD_MOVED or any(claim.quarantined for claim in taken):
                break
        return Claimed(claims, suspect_waiting)

    async def leave_prefix_hints(self, model: str, messages: list[ChatMessage], worker_id: str) -> None:
        """This worker holds the KV of these messages' prompt (common/prefix_hints.py)."""
        await leave_hints(self._redis, model, messages, worker_id)

    async def expire_overdue(self, now_ms: int, most: int = 100) -> int:
        """Fails the jobs still waiting for a first attempt past their queue deadline, as a claim would,
        whether or not a worker of their model is live (up to `most` a call); how many it failed."""
        due: list[str] = await self._redis.zrangebyscore(keys.QUEUE_DEADLINES, "-inf", now_ms, 0, most)
        expired = 0
        for job_id in due:
            model, priority, owner = await self._redis.hmget(keys.job(job_id), ["model", "priority", "owner"])  # type: ignore[misc]
            if model is None:  # expired or purged meanwhile
                await self._redis.zrem(keys.QUEUE_DEADLINES, job_id)
                continue
            script_keys = [
                keys.QUEUE_DEADLINES,
                keys.queued_tokens(model),
                keys.finished(model),
                keys.queue(model, priority or PriorityClass.interactive.value),
                *keys.job_keys(job_id),
                keys.active_jobs(owner or ""),
                keys.prompt_tokens_in_flight(owner or ""),
            ]
            window_ms = RECENT_WINDOW_S * 1000
            args = [job_id, str(now_ms), str(window_ms), _EXPIRED, owner or "", keys.STREAM_NOTICES]
            expired += await self._expire_queued(keys=script_keys, args=args)
        return expired

    async def _claim_candidates(self, model: str, wanted: int, now_ms: int) -> list[str]:
        """The jobs a claim may take: those whose lease ran out, then the head of each class's queue."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(keys.leases(model), "-inf", now_ms)
            for cls in PRIORITY_ORDER:
                pipe.zrange(keys.queue(model, cls.value), 0, wanted - 1)
            expired, *heads = await pipe.execute()
        return list(dict.fromkeys([*expired, *(job_id for head in heads for job_id in head)]))

    async def _owners(self, job_ids: list[str]) -> dict[str, str]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(keys.job(job_id), "owner")
            owners = await pipe.execute()
        return {job_id: owner or "" for job_id, owner in zip(job_ids, owners, strict=True)}

    async def renew_leases(self, claims: list[Claim], lease_s: float) -> int:
        """Push forward the leases of the jobs these claims still hold; returns how many."""
        renewed = 0
        for model in {claim.model for claim in claims}:
            held = [claim for claim in claims if claim.model == model]
            expiry = int((time.time() + lease_s) * 1000)
            args = [str(expiry)]
            for claim in held:
                args += [claim.job_id, str(claim.attempt)]
            script_keys = [keys.leases(model), *(keys.job(claim.job_id) for claim in held)]
            renewed += int(await self._renew(keys=script_keys, args=args))
        return renewed

    async def release(self, claim: Claim, *, preempted: bool = False, behind: bool = False) -> bool:
        """Give a running job back to its queue, in its place (a stopping worker's unfinished job, or
        batch work preempted for interactive work), or `behind` the job at the queue's head (a job
        preempted for another key's); False when the claim no longer holds it."""
        queue = keys.queue(claim.model, claim_priority(claim).value)
        released = await self._release(
            keys=[queue, keys.leases(claim.model), keys.job(claim.job_id)],
            args=[claim.job_id, str(claim.attempt), "1" if preempted else "0", "1" if behind else "0"],
        )
        if released:
            await self._redis.publish(keys.wake_channel(claim.model), claim.job_id)
        return bool(released)

    async def publish(
        self, job_id: str, attempt: int, entries: list[dict[str, str]], record: dict[str, str] | None = None
    ) -> bool:
        """Append entries to the job's stream and set record fields (RecordUpdate.to_fields()) in one
        write; False once the attempt lost the job."""
        args = [str(attempt), *_flat(record or {}), str(len(entries))]
        for entry in entries:
            args += _flat(entry)
        args.append(keys.STREAM_NOTICES)
        written: int = await self._publish(keys=[keys.job(job_id), keys.events(job_id)], args=args)
        return written >= 0

    async def publish_step(
        self, writes: list[StepWrite], reply_after: asyncio.Event | None = None
    ) -> list[StepResult]:
        """Several jobs' entries (and record fields) in one script call, each fenced by its attempt; per
        job, `lost` once its attempt lost the job, `gap` when the stream's tokens end before the write's
        first token entry (see `streamed`). With `reply_after`, the entries are sent at once and the
        outcome is read once that event is set (see HeldConnection)."""
        script_keys: list[str] = []
        args: list[str] = []
        for write in writes:
            script_keys += [keys.job(write.job_id), keys.events(write.job_id)]
            span = write.span
            start, end = ("", "") if span is None else (str(span[0]), str(span[1]))
            args += [str(write.attempt), start if write.check_gap else "", end]
            args += [*_flat(write.record), str(len(write.entries))]
            for entry in write.entries:
                args += _flat(entry)
        args.append(keys.STREAM_NOTICES)
        written: list[int] = await self._step_writes.run_script(
            self._publish_step, script_keys, args, reply_after
        )
        results = {-1: StepResult.lost, -2: StepResult.gap}
        return [results.get(n, StepResult.written) for n in written]

    async def streamed(self, job_id: str) -> int:
        """Where the tokens in the job's stream end: the index the next token entry should have."""
        value = await self._redis.hget(keys.job(job_id), "streamed")  # type: ignore[misc]
        return int(value or 0)

    async def finish(
        self,
        claim: Claim,
        update: RecordUpdate,
        final_entry: dict[str, str],
        *,
        streamed: int | None = None,
    ) -> bool:
        """End the job with its final record fields and stream entry; False once the claim lost it.
        The tokens it served (its usage) settle its owner's fair share. With `streamed` (where the
        attempt's tokens end), raises StreamGap instead when the stream holds fewer."""
        priority = claim_priority(claim).value
        done: int = await self._finish(
            keys=[
                keys.job(claim.job_id),
                keys.events(claim.job_id),
                keys.leases(claim.model),
                keys.arq_job(claim.job_id),
                keys.active_jobs(claim.owner),
                keys.fair_tags(claim.model, priority),
                keys.served_tokens(claim.model),
                keys.prompt_tokens_in_flight(claim.owner),
            ],
            args=[
                str(claim.attempt),
                claim.job_id,
                str(self.ttl_s),
                str(update.usage.total_tokens if update.usage else -1),
                priority,
                "" if streamed is None else str(streamed),
                *_flat(update.to_fields()),
                *_flat(final_entry),
                keys.STREAM_NOTICES,
            ],
        )
        if done == 2:
            raise StreamGap(claim.job_id)
        return bool(done)

    async def fail(self, claim: Claim, message: str, code: ErrorCode | None = None) -> bool:
        """Ends the job as failed; `code` (like context_length_exceeded) names the error for programs."""
        update = RecordUpdate(
            status=JobStatus.failed,
            finish_reason=FinishReason.error,
            error=message,
            error_code=code,
            finished_at=time.time(),
        )
        final = error_entry(JobStatus.failed, message, code.value if code else None)
        return await self.finish(claim, update, final)


async def stage_jobs(redis: Redis, records: list[JobRecord], ttl_s: int = 600) -> None:
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
        notice_streams(pipe, [keys.events(record.id) for record in records])
        await pipe.execute()


def notice_streams(pipe: Pipeline, streams: list[str]) -> None:
    """Tells the gateways' relays that these job streams have new entries, as the job scripts do, for
    writers that add entries themselves (benchmarks' synthetic publishers, tests)."""
    if streams:
        pipe.publish(keys.STREAM_NOTICES, " ".join(dict.fromkeys(streams)))
