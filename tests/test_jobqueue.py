"""The job state machine's transitions on a real Redis: fencing, outcomes, the claim, the record."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import fields

import pytest
from redis.asyncio import Redis

from common import lua
from common.error_codes import ErrorCode
from common.fleet_stats import recent_outcomes
from common.jobs.claims import Claim
from common.jobs.queue import JobQueue
from common.jobs.record import SCRIPT_FIELDS, JobRecord, RecordUpdate
from common.jobs.submission import QueueLimits
from common.keys import ARQ_JOB_PREFIX, PREFIX
from common.wire import FinishReason, JobSpec, JobStatus, PriorityClass, Sampling, Timings, Usage
from tests.conftest import keys

NO_LIMITS = QueueLimits(1000, 10**9, 0)
SCRIPTS = {name: lua.package_source("common.jobs", name) for name in lua.script_names("common.jobs")}


@pytest.fixture
async def model(redis: Redis) -> AsyncIterator[str]:
    """A model name of the test's own; its queue and leases (kept without a TTL) go at the end."""
    name = f"queue-{uuid.uuid4().hex[:8]}"
    yield name
    await redis.delete(keys.queue(name), keys.leases(name))


async def submit(
    queue: JobQueue,
    model: str,
    *,
    limits: QueueLimits = NO_LIMITS,
    age_s: float = 0.0,
    owner: str = "team",
    kv_tokens: int | None = None,
    idempotency_key: str | None = None,
) -> str:
    spec = JobSpec(
        id=f"job_{uuid.uuid4().hex}",
        model=model,
        prompt="Hello",
        sampling=Sampling(max_tokens=4),
        submitted_at=time.time() - age_s,
    )
    await queue.submit(
        spec, limits=limits, cost=5, owner=owner, kv_tokens=kv_tokens, idempotency_key=idempotency_key
    )
    return spec.id


async def test_a_late_release_cannot_put_back_a_job_another_worker_has_claimed(
    redis: Redis, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    job_id = await submit(queue, model)
    [late] = await queue.claim(model, "late-worker", 1, lease_s=0)  # its lease has run out already
    [taken] = await queue.claim(model, "next-worker", 1, lease_s=30)
    assert taken.job_id == job_id and taken.attempt == late.attempt + 1

    assert not await queue.release(late)

    assert await redis.zscore(keys.leases(model), job_id) is not None
    assert await redis.zscore(keys.queue(model), job_id) is None
    assert await queue.claim(model, "third-worker", 1, lease_s=30) == []


async def test_a_worker_that_lost_its_job_cannot_renew_its_lease(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    await submit(queue, model)
    [late] = await queue.claim(model, "late-worker", 1, lease_s=0)
    [taken] = await queue.claim(model, "next-worker", 1, lease_s=30)
    expiry = await redis.zscore(keys.leases(model), taken.job_id)

    assert await queue.renew_leases([late], lease_s=3600) == 0
    assert await redis.zscore(keys.leases(model), taken.job_id) == expiry
    assert await queue.renew_leases([taken], lease_s=60) == 1


async def test_a_job_cancelled_while_queued_counts_in_the_recent_outcomes(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    job_id = await submit(queue, model)

    assert await queue.cancel(job_id, model) == "cancelled"

    outcomes = (await recent_outcomes(redis, keys, [model]))[model]
    assert outcomes.by_status["cancelled"] == 1 and outcomes.finished == 1


async def test_a_job_a_worker_ends_counts_once_in_the_recent_outcomes_and_a_late_attempt_not_at_all(
    redis: Redis, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    await submit(queue, model)
    [late] = await queue.claim(model, "late-worker", 1, lease_s=0)  # its lease has run out already
    [taken] = await queue.claim(model, "next-worker", 1, lease_s=30)
    update = RecordUpdate(
        status=JobStatus.succeeded, output="hi", finish_reason=FinishReason.stop, finished_at=1.0
    )

    assert not await queue.finish(late, update, {"type": "done", "status": "succeeded"})
    assert (await recent_outcomes(redis, keys, [model]))[model].finished == 0

    assert await queue.finish(taken, update, {"type": "done", "status": "succeeded"})
    await queue.finish(taken, update, {"type": "done", "status": "succeeded"})  # a retry, its reply lost
    outcomes = (await recent_outcomes(redis, keys, [model]))[model]
    assert outcomes.by_status == {"succeeded": 1}


async def test_a_job_that_expires_in_the_queue_counts_as_failed_in_the_recent_outcomes(
    redis: Redis, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    job_id = await submit(queue, model, limits=QueueLimits(1000, 10**9, 1.0), age_s=5.0)

    assert await queue.claim(model, "worker", 1, lease_s=30) == []

    record = await queue.record(job_id)
    assert record is not None and record.status is JobStatus.failed
    assert record.error_code is ErrorCode.expired_in_queue
    assert await redis.zscore(keys.active_jobs("team"), job_id) is None  # no longer counts for its owner
    assert (await recent_outcomes(redis, keys, [model]))[model].failed == 1


async def test_a_claim_looks_again_when_the_head_of_the_queue_moves_under_it(
    redis: Redis, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = JobQueue(redis, 3600, keys)
    later = await submit(queue, model)
    handed_back = await submit(queue, model)
    await redis.zrem(keys.queue(model), handed_back)
    peek = queue._claim_candidates
    looks = 0

    async def peek_then_move_the_head(model: str, wanted: int, now_ms: int) -> list[str]:
        nonlocal looks
        looks += 1
        candidates = await peek(model, wanted, now_ms)
        if looks == 1:  # another worker hands a job back to the head between the look and the claim
            await redis.zadd(keys.queue(model), {handed_back: 0})
        return candidates

    monkeypatch.setattr(queue, "_claim_candidates", peek_then_move_the_head)
    claims = await queue.claim(model, "worker", 1, lease_s=30)

    assert [claim.job_id for claim in claims] == [handed_back]
    assert looks == 2
    assert await redis.zrange(keys.queue(model), 0, -1) == [later]


async def test_a_claim_takes_the_job_a_row_was_freed_for_wherever_it_waits_then_the_head(
    redis: Redis, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    ahead = [await submit(queue, model, owner="team-a") for _ in range(3)]
    promised = await submit(queue, model, owner="team-b")
    gone = await submit(queue, model, owner="team-b")
    [taken] = await queue.claim(model, "another-worker", 1, lease_s=30)
    assert taken.job_id == ahead[0]
    await redis.zrem(keys.queue(model), gone)  # claimed elsewhere: a promise no longer waiting

    claimed = await queue.claim_jobs(
        model, "worker", 2, lease_s=30, promised={promised: "team-b", gone: "team-b"}
    )

    assert [claim.job_id for claim in claimed.claims] == [promised, ahead[1]]
    assert await redis.zrange(keys.queue(model), 0, -1) == [ahead[2]]


async def test_a_claim_carries_what_the_worker_needs_to_end_the_job(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    job_id = await submit(queue, model, owner="team-a")
    [claim] = await queue.claim(model, "worker", 1, lease_s=30)
    assert claim == Claim(job_id, 1, claim.payload, model, "team-a")

    update = RecordUpdate(
        status=JobStatus.succeeded, output="hi", finish_reason=FinishReason.stop, finished_at=1.0
    )
    assert await queue.finish(claim, update, {"type": "done", "status": "succeeded"})

    assert await redis.zscore(keys.active_jobs("team-a"), job_id) is None
    assert await redis.zscore(keys.leases(model), job_id) is None


@pytest.mark.unit
def test_a_record_reads_back_as_it_was_written() -> None:
    record = JobRecord(
        id="job_1",
        model="tiny",
        status=JobStatus.failed,
        created_at=1700000000.25,
        attempts=2,
        owner="team",
        cost=12,
        idempotency_key=keys.idempotency("abc"),
        deadline_ms=1700000001000,
        priority=PriorityClass.batch,
        worker="w-1",
        started_at=1700000000.5,
        first_token_at=1700000000.75,
        cancel_requested=True,
        output="",
        finish_reason=FinishReason.error,
        usage=Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7),
        timings=Timings(queue_wait_s=0.25),
        error="too long",
        error_code=ErrorCode.context_length_exceeded,
        engine_batch_peak=3,
        finished_at=1700000001.0,
        suspect=True,
        worker_deaths=2,
        quarantine_deaths=1,
        quarantined_attempt=2,
        resumed_from=40,
        resumes=1,
        resume_exact=False,  # kept: an inexact resume is not the same as no resume
    )
    assert JobRecord.from_fields(record.to_fields()) == record


async def ttls(redis: Redis, *names: str) -> list[int]:
    return [await redis.ttl(name) for name in names]


async def test_a_job_ended_in_its_queue_keeps_its_data_for_the_job_ttl_from_its_end(
    redis: Redis, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    owner = f"owner-{uuid.uuid4().hex[:8]}"
    idem = keys.idempotency(uuid.uuid4().hex)
    cancelled = await submit(queue, model, owner=owner, idempotency_key=idem)
    expiring = await submit(queue, model, owner=owner, limits=QueueLimits(1000, 10**9, 1.0), age_s=5.0)
    kept = [keys.job(cancelled), keys.events(cancelled), idem, keys.job(expiring), keys.events(expiring)]
    assert await ttls(redis, *kept, keys.owner_jobs(owner), keys.queue(model)) == [-1] * 7

    assert await queue.cancel(cancelled, model) == "cancelled"
    assert await queue.expire_overdue(int(time.time() * 1000)) >= 1

    assert all(3590 < ttl <= 3600 for ttl in await ttls(redis, *kept, keys.owner_jobs(owner)))
    assert await redis.exists(keys.queue(model), keys.queued_tokens(model), keys.active_jobs(owner)) == 0


async def test_a_claim_passes_over_jobs_that_need_more_kv_than_the_workers_budget(
    redis: Redis, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    large = await submit(queue, model, kv_tokens=300)
    small = await submit(queue, model, kv_tokens=50)

    taken_by_small = await queue.claim(model, "small-worker", 2, lease_s=30, kv_budget_tokens=128)
    taken_by_large = await queue.claim(model, "large-worker", 2, lease_s=30, kv_budget_tokens=512)

    assert [claim.job_id for claim in taken_by_small] == [small]
    assert [claim.job_id for claim in taken_by_large] == [large]


@pytest.mark.unit
def test_the_scripts_build_no_key_names() -> None:
    for name, script in SCRIPTS.items():
        assert PREFIX not in script and ARQ_JOB_PREFIX not in script, name
        assert not re.search(r"redis\.call\('\w+', [^,)]*\.\.", script), name


# Quoted words in the scripts that are values, not record fields.
_VALUES = {s.value for s in JobStatus} | {r.value for r in FinishReason} | {c.value for c in ErrorCode}
_VALUES |= {"type", "message", "code", "created", "duplicate", "busy", "full", "jobs", "tokens", "epoch"}
_VALUES |= {"missing", "cancelling", "prompt_tokens", "stream_bytes"}
_VALUES |= {"reason", "worker_lost", "attempt"}  # the stream event of a worker's death


@pytest.mark.unit
def test_the_scripts_name_only_fields_of_the_record() -> None:
    record_fields = {f.name for f in fields(JobRecord)}
    assert record_fields >= SCRIPT_FIELDS
    for name, script in SCRIPTS.items():
        named = set(re.findall(r"'([a-z_]+)'", script)) - _VALUES
        assert named <= SCRIPT_FIELDS, (name, named - SCRIPT_FIELDS)


@pytest.mark.unit
def test_every_entry_a_script_adds_to_a_jobs_stream_keeps_the_records_tail() -> None:
    """The step writes take the id of a stream's newest entry from the record's `tail`: an entry added
    without it would be skipped by a reader that takes the step write's entries from its notice."""
    helper = lua.package_source("common.jobs", "append.lua")
    for name, script in SCRIPTS.items():
        if name in ("append.lua", "publish_step.lua"):
            continue
        assert script.count("'XADD'") == helper.count("'XADD'") * ("append_event(" in script), name
    step = SCRIPTS["publish_step.lua"]
    assert step.count("'XADD'") == 1 and "'tail'" in step


async def test_a_deadline_whose_job_cannot_be_read_holds_up_no_other_jobs_expiry(
    redis: Redis, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    broken = f"job_broken_{uuid.uuid4().hex[:8]}"
    await redis.set(keys.job(broken), "not a hash")  # any command on it as a hash answers WRONGTYPE
    await redis.zadd(keys.queue_deadlines, {broken: 1})  # overdue before every other deadline
    expiring = await submit(queue, model, limits=QueueLimits(1000, 10**9, 1.0), age_s=5.0)
    try:
        assert await queue.expire_overdue(int(time.time() * 1000)) >= 1
        assert await redis.hget(keys.job(expiring), "status") == "failed"
    finally:
        await redis.zrem(keys.queue_deadlines, broken)
        await redis.delete(keys.job(broken))
