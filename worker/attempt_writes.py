"""What one attempt of a job writes besides its tokens: the running event it starts with, and the final
record and done (or error) event it ends with, written through a Redis outage."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from redis.exceptions import RedisError

from common.error_codes import ErrorCode
from common.events import done_entry, error_entry, status_entry
from common.jobs.claims import Claim
from common.jobs.queue import JobQueue
from common.jobs.record import RecordUpdate
from common.jobs.writes import StreamGap
from common.wire import FinishReason, JobStatus, PriorityClass, PromptTokensDetails, Timings, Usage
from worker.publisher import LeaseLost, StreamPublisher

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    status: JobStatus
    finish_reason: FinishReason | None
    text: str
    generated: int
    error: str | None = None
    error_code: ErrorCode | None = None
    closed_early: bool | None = None  # True: closed early within max_tokens; False: cut, closing off


def running_writes(
    claim: Claim, worker_id: str, prompt_tokens: int, resumed_from: int
) -> tuple[dict[str, str], dict[str, str] | None]:
    """The attempt's first event, and what its record gets with it: a resumed attempt says from which
    token (`resumed_from`: those earlier attempts streamed), a quarantined one says so."""
    first = claim.attempt == 1
    entry = status_entry(
        JobStatus.running,
        attempt=claim.attempt,
        worker=worker_id,
        prompt_tokens=prompt_tokens,
        resumed_from=None if first else resumed_from,
        quarantined="true" if claim.quarantined else None,
    )
    record = None if first else RecordUpdate(resumed_from=resumed_from, resumes=claim.attempt - 1).to_fields()
    return entry, record


def final_writes(
    outcome: Outcome,
    *,
    submitted_at: float,
    started_at: float,
    first_token_at: float | None,
    token_times: list[float],
    prompt_tokens: int,
    cached_tokens: int | None,
    batch_peak: int,
    now: float,
) -> tuple[RecordUpdate, dict[str, str]]:
    """The job's final record (usage, timings) and its last event, done or, for a failed job, error."""
    usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=outcome.generated,
        total_tokens=prompt_tokens + outcome.generated,
        prompt_tokens_details=None
        if cached_tokens is None
        else PromptTokensDetails(cached_tokens=cached_tokens),
    )
    times = token_times
    timings = Timings(
        queue_wait_s=round(started_at - submitted_at, 6),
        ttft_s=round(first_token_at - submitted_at, 6) if first_token_at else None,
        time_per_output_token_s=round((times[-1] - times[0]) / (outcome.generated - 1), 6)
        if len(times) > 1 and outcome.generated > 1
        else None,
        total_s=round(now - submitted_at, 6),
    )
    record = RecordUpdate(
        status=outcome.status,
        output=outcome.text,
        usage=usage,
        timings=timings,
        finished_at=now,
        engine_batch_peak=batch_peak,
        finish_reason=outcome.finish_reason,
        error=outcome.error or None,
        error_code=outcome.error_code,
        closed_early=outcome.closed_early,
    )
    reason = outcome.finish_reason.value if outcome.finish_reason else None
    final = done_entry(outcome.status, reason, usage.model_dump_json(), closed_early=outcome.closed_early)
    if outcome.status is JobStatus.failed:  # as every failed job: an error event with its code
        code = outcome.error_code or ErrorCode.job_failed
        final = error_entry(outcome.status, outcome.error or "the job failed", code.value)
    return record, final


async def write_final(
    queue: JobQueue,
    claim: Claim,
    record: RecordUpdate,
    final: dict[str, str],
    publisher: StreamPublisher,
    priority: PriorityClass | None = None,
) -> None:
    """Retries through a Redis outage: a finished job is never lost (writes stay fenced). After a
    failover that lost the newest token entries, writes them again before the final one. `priority`:
    the job's class, when its spec is at hand (else it is read from the claim's payload)."""
    delay = 0.1
    while True:
        streamed = None if publisher.unfillable else publisher.streamed_to
        try:
            await queue.finish(claim, record, final, streamed=streamed, priority=priority)
            return
        except StreamGap:
            logger.warning(
                "job %s: its stream lacks tokens written before (a failover?); writing them again",
                claim.job_id,
            )
            try:
                await publisher.fill_gap()
            except LeaseLost:
                return
        except RedisError as e:
            logger.warning("job %s: writing the result failed (%s); retrying", claim.job_id, e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
