"""Reading a job's record out of Redis."""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.wire import FinishReason, JobLinks, JobStatus, JobView, Timings, Usage


async def load_record(redis: Redis, job_id: str) -> dict[str, str] | None:
    fields: dict[str, str] = await redis.hgetall(keys.job(job_id))  # type: ignore[misc]
    return fields or None


def _json(fields: dict[str, str], key: str) -> Any:
    raw = fields.get(key)
    return json.loads(raw) if raw else None


def record_view(fields: dict[str, str], links: JobLinks, queue_position: int | None = None) -> JobView:
    status = JobStatus(fields["status"])
    usage = _json(fields, "usage")
    timings = _json(fields, "timings")
    peak = fields.get("engine_batch_peak")
    finish = fields.get("finish_reason")
    return JobView(
        id=fields["id"],
        status=status,
        model=fields["model"],
        created_at=float(fields["created_at"]),
        attempts=int(fields.get("attempts", "0")),
        worker=fields.get("worker"),
        queue_position=queue_position if status is JobStatus.queued else None,
        output=fields.get("output"),
        finish_reason=FinishReason(finish) if finish else None,
        usage=Usage(**usage) if usage else None,
        timings=Timings(**timings) if timings else None,
        error=fields.get("error"),
        error_code=fields.get("error_code"),
        engine_batch_peak=int(peak) if peak else None,
        links=links,
    )
