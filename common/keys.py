"""Every Redis key and channel ortfleet uses, in one place."""

from __future__ import annotations

from arq.constants import job_key_prefix as _arq_job_prefix

ARQ_JOB_PREFIX: str = _arq_job_prefix

PREFIX = "ortfleet:"

WORKERS = PREFIX + "workers"  # zset: worker id -> heartbeat expiry (ms)
MODELS = PREFIX + "models"  # hash: model name -> JSON of what its workers last reported
CANCEL_CHANNEL = PREFIX + "cancel"  # pub/sub: job ids whose running generation must stop


def job(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def events(job_id: str) -> str:
    return f"{PREFIX}events:{job_id}"


def arq_job(job_id: str) -> str:
    return ARQ_JOB_PREFIX + job_id


def queue(model: str) -> str:
    return f"{PREFIX}queue:{model}"


def leases(model: str) -> str:
    return f"{PREFIX}leases:{model}"


def queued_tokens(model: str) -> str:
    return f"{PREFIX}queued-tokens:{model}"


def finished(model: str) -> str:
    """zset: "<status>:<job id>" of jobs that finished on a worker -> finish time (ms), last minute only."""
    return f"{PREFIX}finished:{model}"


def request_rate(owner: str) -> str:
    return f"{PREFIX}rate:{owner}"


def active_jobs(owner: str) -> str:
    return f"{PREFIX}active:{owner}"


def owner_jobs(owner: str) -> str:
    return f"{PREFIX}jobs-of:{owner}"


def wake_channel(model: str) -> str:
    return f"{PREFIX}wake:{model}"


def worker(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def idempotency(digest: str) -> str:
    return f"{PREFIX}idem:{digest}"
