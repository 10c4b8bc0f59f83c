"""A job's record: its typed model and its Redis encoding (a hash of strings at Keyspace.job(id)).

The gateway writes the record when it queues the job; the state machine's Lua scripts
(common/jobs/scripts/) read and set the fields named in SCRIPT_FIELDS; a worker writes RecordUpdates,
fenced by its attempt number. Everything else reads the record through JobRecord.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from pydantic import BaseModel
from redis.asyncio import Redis

from common.error_codes import ErrorCode
from common.keys import Keyspace
from common.wire import FinishReason, JobLinks, JobStatus, JobView, PriorityClass, Timings, Usage

# Fields the Lua scripts read or write by name.
SCRIPT_FIELDS = frozenset(
    {
        "status",
        "attempts",
        "owner",
        "cost",
        "kv_tokens",
        "idempotency_key",
        "deadline_ms",
        "created_at",
        "worker",
        "started_at",
        "cancel_requested",
        "finish_reason",
        "finished_at",
        "error",
        "error_code",
        "priority",
        "weight",
        "tag",
        "preemptions",
        "suspect",
        "worker_deaths",
        "quarantine_deaths",
        "quarantined_attempt",
        "streamed",
        "tail",
        "preferred_worker",
        "preferred_until_ms",
    }
)


def _encode(values: dict[str, Any]) -> dict[str, str]:
    """Hash fields as strings; None (and False) leave the field out."""
    out: dict[str, str] = {}
    for name, value in values.items():
        if value is None or value is False:
            continue
        if value is True:
            out[name] = "1"
        elif isinstance(value, Enum):
            out[name] = str(value.value)
        elif isinstance(value, BaseModel):
            out[name] = value.model_dump_json()
        else:
            out[name] = str(value)
    return out


def _to_fields(record: JobRecord | RecordUpdate) -> dict[str, str]:
    """The dataclass's fields as hash fields; resume_exact and closed_early keep False ("0"): an inexact
    resume, or a document cut with its closing off, is news, unlike a flag left unset."""
    out = _encode({f.name: getattr(record, f.name) for f in fields(record)})
    for name in ("resume_exact", "closed_early"):
        if getattr(record, name) is False:
            out[name] = "0"
    return out


def _float(raw: str | None) -> float | None:
    return float(raw) if raw else None


def _int(raw: str | None) -> int | None:
    return int(raw) if raw else None


@dataclass(frozen=True, kw_only=True)
class JobOutcome:
    """The fields of what a job gave, which its worker writes: in the record and in a RecordUpdate."""

    output: str | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None
    error_code: ErrorCode | None = None
    engine_batch_peak: int | None = None
    finished_at: float | None = None
    closed_early: bool | None = None  # True: closed early within max_tokens; False: cut, closing off


@dataclass(frozen=True)
class JobRecord(JobOutcome):
    id: str
    model: str  # the served model, whose queue and stores hold the job
    status: JobStatus
    created_at: float
    attempts: int = 0  # claims so far; a worker's writes carry the attempt they belong to
    owner: str = ""  # the API key's name
    cost: int = 0  # tokens it holds in the model's queued-token count until it first starts
    kv_tokens: int | None = None  # KV tokens it needs (prompt and max_tokens): smaller budgets leave it
    idempotency_key: str | None = None  # the Redis key of its idempotency entry
    request_digest: str | None = None  # sha256 of the request, to tell a retry from a reused key
    deadline_ms: int | None = None  # still queued after this, it fails as expired
    priority: PriorityClass = PriorityClass.interactive
    worker: str | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    cancel_requested: bool = False
    weight: float = 1.0  # the owner's weight when it was submitted
    tag: int | None = None  # its score in its class's queue: its place (set by the submit script)
    preemptions: int = 0  # times it went back to the queue for interactive work: not attempts
    # A worker died holding the job: suspect, its next attempts run alone on their worker (quarantine).
    suspect: bool = False
    worker_deaths: int = 0
    quarantine_deaths: int = 0  # deaths while it ran in quarantine: at ORTFLEET_MAX_ATTEMPTS, poison
    quarantined_attempt: int | None = None  # the attempt that ran in quarantine last
    resumed_from: int | None = None  # tokens already streamed when the last attempt resumed the job
    resumes: int | None = None
    resume_exact: bool | None = None  # whether the resume's replay computed every streamed token again
    streamed: int | None = None  # where its stream's tokens end (the next token index), set by the writes
    tail: str | None = None  # the id of its stream's newest entry, kept by every script that adds one
    # The worker that holds its prompt's KV (common/prefix_hints.py): until `preferred_until_ms`, the
    # claim leaves the job to that worker.
    preferred_worker: str | None = None
    preferred_until_ms: int | None = None
    adapter: str | None = None  # the LoRA adapter the request named as its model (None: the model itself)

    @property
    def requested_model(self) -> str:
        """The name the request gave its model, which answers show: the adapter's, when it named one."""
        return self.adapter or self.model

    def to_fields(self) -> dict[str, str]:
        return _to_fields(self)

    @classmethod
    def from_fields(cls, raw: dict[str, str]) -> JobRecord:
        usage, timings = raw.get("usage"), raw.get("timings")
        finish, code = raw.get("finish_reason"), raw.get("error_code")
        return cls(
            id=raw["id"],
            model=raw["model"],
            status=JobStatus(raw["status"]),
            created_at=float(raw["created_at"]),
            attempts=int(raw.get("attempts") or 0),
            owner=raw.get("owner", ""),
            cost=int(raw.get("cost") or 0),
            kv_tokens=_int(raw.get("kv_tokens")),
            idempotency_key=raw.get("idempotency_key") or None,
            request_digest=raw.get("request_digest") or None,
            deadline_ms=_int(raw.get("deadline_ms")),
            priority=PriorityClass(raw.get("priority") or PriorityClass.interactive.value),
            worker=raw.get("worker"),
            started_at=_float(raw.get("started_at")),
            first_token_at=_float(raw.get("first_token_at")),
            cancel_requested=raw.get("cancel_requested") == "1",
            output=raw.get("output"),
            finish_reason=FinishReason(finish) if finish else None,
            usage=Usage.model_validate_json(usage) if usage else None,
            timings=Timings.model_validate_json(timings) if timings else None,
            error=raw.get("error"),
            error_code=ErrorCode(code) if code else None,
            engine_batch_peak=_int(raw.get("engine_batch_peak")),
            finished_at=_float(raw.get("finished_at")),
            closed_early={"1": True, "0": False}.get(raw.get("closed_early", "")),
            weight=float(raw.get("weight") or 1.0),
            tag=_int(raw.get("tag")),
            preemptions=int(raw.get("preemptions") or 0),
            suspect=raw.get("suspect") == "1",
            worker_deaths=int(raw.get("worker_deaths") or 0),
            quarantine_deaths=int(raw.get("quarantine_deaths") or 0),
            quarantined_attempt=_int(raw.get("quarantined_attempt")),
            resumed_from=_int(raw.get("resumed_from")),
            resumes=_int(raw.get("resumes")),
            resume_exact=raw["resume_exact"] == "1" if raw.get("resume_exact") else None,
            streamed=_int(raw.get("streamed")),
            tail=raw.get("tail"),
            adapter=raw.get("adapter") or None,
        )

    def view(
        self, links: JobLinks, queue_position: int | None = None, queue_eta_s: float | None = None
    ) -> JobView:
        """The job as the API shows it."""
        return JobView(
            id=self.id,
            status=self.status,
            model=self.requested_model,
            created_at=self.created_at,
            attempts=self.attempts,
            worker=self.worker,
            priority=self.priority,
            queue_position=queue_position if self.status is JobStatus.queued else None,
            queue_eta_s=queue_eta_s if self.status is JobStatus.queued else None,
            preemptions=self.preemptions,
            output=self.output,
            finish_reason=self.finish_reason,
            closed_early=self.closed_early,
            usage=self.usage,
            timings=self.timings,
            error=self.error,
            error_code=self.error_code.value if self.error_code else None,
            engine_batch_peak=self.engine_batch_peak,
            worker_deaths=self.worker_deaths,
            quarantine_deaths=self.quarantine_deaths,
            resumed_from=self.resumed_from,
            resume_exact=self.resume_exact,
            links=links,
        )


@dataclass(frozen=True)
class RecordUpdate(JobOutcome):
    """Fields a worker sets on the record while it runs the job or when it ends it."""

    status: JobStatus | None = None
    first_token_at: float | None = None
    resumed_from: int | None = None
    resumes: int | None = None
    resume_exact: bool | None = None

    def to_fields(self) -> dict[str, str]:
        return _to_fields(self)


async def load_record(redis: Redis, job_id: str, keys: Keyspace) -> JobRecord | None:
    raw: dict[str, str] = await redis.hgetall(keys.job(job_id))  # type: ignore[misc]
    return JobRecord.from_fields(raw) if raw else None
