"""A worker's writes into the jobs it runs, each fenced by its attempt: stream entries and record fields
(publish.lua, and publish_step.lua for all of an engine step's jobs at once), and the job's end
(finish.lua)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import IntEnum

import orjson
from redis.asyncio import Redis

from common import lua
from common.error_codes import ErrorCode
from common.events import TOKEN, entry_token_count, error_entry
from common.fleet_stats import RECENT_WINDOW_S
from common.jobs.claims import Claim, claim_priority
from common.jobs.record import RecordUpdate
from common.keys import Keyspace
from common.redis_client import HeldConnection
from common.wire import FinishReason, JobStatus, PriorityClass


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


# publish_step.lua's reply per job: the entries written, or one of these.
_STEP_REFUSALS = {-1: StepResult.lost, -2: StepResult.gap}


class FinishOutcome(IntEnum):
    """finish.lua's reply."""

    lost = 0  # another attempt owns the job: nothing written
    finished = 1
    gap = 2  # nothing written: the stream holds fewer tokens than the attempt streamed


class StreamGap(Exception):
    """The job's stream holds fewer tokens than the attempt wrote: they must be written again first."""


def token_span(entries: list[dict[str, str]]) -> tuple[int, int] | None:
    """The token index of the first token entry among `entries`, and the index past the last one."""
    first = last = None
    for entry in entries:
        if entry.get("type") == TOKEN and "index" in entry:
            last = entry
            if first is None:
                first = entry
    if first is None or last is None:
        return None
    return int(first["index"]), int(last["index"]) + entry_token_count(last)


def _entries(entries: list[dict[str, str]]) -> list[str]:
    out = [str(len(entries))]
    for entry in entries:
        out += lua.flat_fields(entry)
    return out


def _step_entries(entries: list[dict[str, str]]) -> list[str]:
    """As _entries, each entry followed by its fields as a JSON array, for the stream notice."""
    out = [str(len(entries))]
    for entry in entries:
        fields = lua.flat_fields(entry)
        out += fields
        out.append(orjson.dumps(fields[1:]).decode())
    return out


class PublishScript:
    """publish.lua: False once the attempt lost the job."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "publish.lua")

    async def __call__(
        self, *, job_id: str, attempt: int, entries: list[dict[str, str]], record: dict[str, str]
    ) -> bool:
        args = [str(attempt), *lua.flat_fields(record), *_entries(entries), self.keys.stream_notices]
        written: int = await self._script(keys=[self.keys.job(job_id), self.keys.events(job_id)], args=args)
        return written >= 0


class PublishStepScript:
    """publish_step.lua, run on a connection of its own (HeldConnection), one call after another."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "publish_step.lua")
        self._connection = HeldConnection(redis)

    async def __call__(
        self, *, writes: list[StepWrite], reply_after: asyncio.Event | None
    ) -> list[StepResult]:
        script_keys: list[str] = []
        args: list[str] = []
        for write in writes:
            script_keys += [self.keys.job(write.job_id), self.keys.events(write.job_id)]
            span = write.span
            start, end = ("", "") if span is None else (str(span[0]), str(span[1]))
            args += [str(write.attempt), start if write.check_gap else "", end]
            args += [*lua.flat_fields(write.record), *_step_entries(write.entries)]
        args.append(self.keys.stream_notices)
        written: list[int] = await self._connection.run_script(self._script, script_keys, args, reply_after)
        return [_STEP_REFUSALS.get(n, StepResult.written) for n in written]


class FinishScript:
    """finish.lua."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "finish.lua")

    async def __call__(
        self,
        *,
        claim: Claim,
        ttl_s: int,
        served_tokens: int | None,
        record: dict[str, str],
        final_entry: dict[str, str],
        streamed: int | None,
        priority: PriorityClass | None = None,
    ) -> FinishOutcome:
        fair_class = (priority or claim_priority(claim)).value  # the payload parsed only when not given
        done: int = await self._script(
            keys=[
                self.keys.job(claim.job_id),
                self.keys.events(claim.job_id),
                self.keys.leases(claim.model),
                self.keys.arq_job(claim.job_id),
                self.keys.active_jobs(claim.owner),
                self.keys.fair_tags(claim.model, fair_class),
                self.keys.served_tokens(claim.model),
                self.keys.prompt_tokens_in_flight(claim.owner),
                self.keys.owner_jobs(claim.owner),
                self.keys.owner_ended_jobs(claim.owner),
                self.keys.finished(claim.model),
                *([claim.idempotency_key] if claim.idempotency_key else []),
            ],
            args=[
                str(claim.attempt),
                claim.job_id,
                str(ttl_s),
                str(-1 if served_tokens is None else served_tokens),
                fair_class,
                "" if streamed is None else str(streamed),
                str(int(time.time() * 1000)),
                record.get("status", ""),
                str(RECENT_WINDOW_S * 1000),
                *lua.flat_fields(record),
                *lua.flat_fields(final_entry),
                self.keys.stream_notices,
            ],
        )
        return FinishOutcome(done)


class JobWrites:
    """JobQueue's writes of a worker into its jobs."""

    keys: Keyspace
    ttl_s: int
    _publish: PublishScript
    _publish_step: PublishStepScript
    _finish: FinishScript

    async def publish(
        self, job_id: str, attempt: int, entries: list[dict[str, str]], record: dict[str, str] | None = None
    ) -> bool:
        """Append entries to the job's stream and set record fields (RecordUpdate.to_fields()) in one
        write; False once the attempt lost the job."""
        return await self._publish(job_id=job_id, attempt=attempt, entries=entries, record=record or {})

    async def publish_step(
        self, writes: list[StepWrite], reply_after: asyncio.Event | None = None
    ) -> list[StepResult]:
        """Several jobs' entries (and record fields) in one script call, each fenced by its attempt; per
        job, `lost` once its attempt lost the job, `gap` when the stream's tokens end before the write's
        first token entry (see `streamed`). With `reply_after`, the entries are sent at once and the
        outcome is read once that event is set (see HeldConnection)."""
        return await self._publish_step(writes=writes, reply_after=reply_after)

    async def finish(
        self,
        claim: Claim,
        update: RecordUpdate,
        final_entry: dict[str, str],
        *,
        streamed: int | None = None,
        priority: PriorityClass | None = None,
    ) -> bool:
        """End the job with its final record fields and stream entry; False once the claim lost it.
        The tokens it served (its usage) settle its owner's fair share. With `streamed` (where the
        attempt's tokens end), raises StreamGap instead when the stream holds fewer."""
        outcome = await self._finish(
            claim=claim,
            ttl_s=self.ttl_s,
            served_tokens=update.usage.total_tokens if update.usage else None,
            record=update.to_fields(),
            final_entry=final_entry,
            streamed=streamed,
            priority=priority,
        )
        if outcome is FinishOutcome.gap:
            raise StreamGap(claim.job_id)
        return outcome is FinishOutcome.finished

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
