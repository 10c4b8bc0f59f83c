"""Every Redis key and channel ortfleet names, and the functions that derive them.

The Lua scripts (common/jobs/scripts/, gateway/) build no key names: their wrappers derive every key
here and pass it in KEYS.
"""

from __future__ import annotations

from typing import NamedTuple

from arq.constants import job_key_prefix as _arq_job_prefix

ARQ_JOB_PREFIX: str = _arq_job_prefix

PREFIX = "ortfleet:"

WORKERS = PREFIX + "workers"  # zset: worker id -> heartbeat expiry (ms)
MODELS = PREFIX + "models"  # hash: model name -> JSON of what its workers last reported
CANCEL_CHANNEL = PREFIX + "cancel"  # pub/sub: job ids whose running generation must stop
STREAM_NOTICES = PREFIX + "stream-notices"  # pub/sub: job stream keys just added to (common/jobs/)
EPOCH = PREFIX + "epoch"  # string: this Redis's data epoch (common/store_epoch.py); job TTL, renewed by reads
QUEUE_DEADLINES = PREFIX + "queue-deadlines"  # zset: queued job id -> its queue deadline (ms); no expiry
LOST_EPOCHS = PREFIX + "lost-epochs"  # set: epochs whose data this Redis lost (restarted empty); job TTL


def job(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def events(job_id: str) -> str:
    return f"{PREFIX}events:{job_id}"


def arq_job(job_id: str) -> str:
    return ARQ_JOB_PREFIX + job_id


class JobKeys(NamedTuple):
    """The keys of one job, all derived from its id."""

    record: str
    events: str
    arq_job: str


def job_keys(job_id: str) -> JobKeys:
    return JobKeys(job(job_id), events(job_id), arq_job(job_id))


def queue(model: str, priority: str = "interactive") -> str:
    """zset: the model's waiting jobs of one priority class -> their fair-share tag
    (common/jobs/scripts/fair.lua)."""
    if priority == "interactive":
        return f"{PREFIX}queue:{model}"
    return f"{PREFIX}queue:{model}:{priority}"


def fair_tags(model: str, priority: str) -> str:
    """hash: per key of a model's priority class, the finish tag of its last job; ":v" the class's
    virtual time, ":seq" its submission counter (common/jobs/scripts/fair.lua)."""
    return f"{PREFIX}fair:{model}:{priority}"


def preempting(model: str) -> str:
    """string: engine slots workers are freeing for the model's waiting interactive jobs (short-lived)."""
    return f"{PREFIX}preempting:{model}"


def served_tokens(model: str) -> str:
    """hash: "<class>" and "<class>:<key>" -> tokens served (prompt and generated) by finished jobs;
    it expires a job TTL after the last one."""
    return f"{PREFIX}served:{model}"


def leases(model: str) -> str:
    return f"{PREFIX}leases:{model}"


def queued_tokens(model: str) -> str:
    return f"{PREFIX}queued-tokens:{model}"


def finished(model: str) -> str:
    """zset: "<status>:<job id>" of jobs that ended (on a worker or in the queue) -> end time (ms),
    last minute only."""
    return f"{PREFIX}finished:{model}"


def request_rate(owner: str) -> str:
    return f"{PREFIX}rate:{owner}"


def tokenize_budget(owner: str) -> str:
    """string: when the key's /tokenize budget is full again (ms; the rate limit's theoretical arrival)."""
    return f"{PREFIX}tokenize-budget:{owner}"


def active_jobs(owner: str) -> str:
    return f"{PREFIX}active:{owner}"


def prompt_tokens_in_flight(owner: str) -> str:
    """hash: the estimated prompt tokens of each of the key's active jobs (those in active_jobs) by job id,
    and ":total" their sum; the estimated bytes of each one's stream under "bytes:" and its id, and ":bytes"
    their sum (the job scripts charge and release both with the job's state)."""
    return f"{PREFIX}prompt-tokens:{owner}"


def owner_jobs(owner: str) -> str:
    """zset: every job of the owner -> its submission (ms), while its record lives: listing and ownership."""
    return f"{PREFIX}jobs-of:{owner}"


def owner_ended_jobs(owner: str) -> str:
    """zset: the owner's jobs that ended -> their end (ms): a submission drops from owner_jobs those that
    ended a job TTL ago (their records expired), and never a queued or running one."""
    return f"{PREFIX}ended-of:{owner}"


def wake_channel(model: str) -> str:
    return f"{PREFIX}wake:{model}"


def worker(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def prefix_hint(model: str, digest: str) -> str:
    """The worker that holds the prompt KV of a chat's leading messages (common/prefix_hints.py)."""
    return f"{PREFIX}prefix-hint:{model}:{digest}"


def idempotency(digest: str) -> str:
    return f"{PREFIX}idem:{digest}"


def idempotency_try(idempotency_key: str) -> str:
    """string, on the key's home store of a model with several: a token of the gateway whose try of the key
    is in flight, so that tries of one key go one at a time (gateway/idempotency.py); short-lived."""
    return f"{idempotency_key}:trying"


def idempotency_tries(idempotency_key: str) -> str:
    """set, on the key's home store of a model with several (gateway/placement.py's key_home): the other
    stores a try of the key went to, by label; job TTL."""
    return f"{idempotency_key}:tried"


# The OpenAI async APIs (files, batches, responses), kept by the gateways.
BATCHES_ACTIVE = (
    PREFIX + "batches:active"
)  # zset: batch id -> creation time (ms), while a driver owes it work


def file(file_id: str) -> str:
    return f"{PREFIX}file:{file_id}"


def file_lines(file_id: str) -> str:
    """list: the file's lines, each with its line break, in order."""
    return f"{PREFIX}file-lines:{file_id}"


def owner_files(owner: str) -> str:
    return f"{PREFIX}files-of:{owner}"


class FileQuotaKeys(NamedTuple):
    """What one key keeps in files (gateway/files/quota.py), each living as long as its latest file."""

    sizes: str  # hash: file id -> bytes (a file still arriving: those held for it)
    expiries: str  # zset: file id -> its expiry (ms)
    total: str  # string: the sum of the sizes


def file_quota(owner: str) -> FileQuotaKeys:
    return FileQuotaKeys(
        f"{PREFIX}file-sizes:{owner}", f"{PREFIX}file-expiries:{owner}", f"{PREFIX}file-bytes:{owner}"
    )


def batch(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}"


def batch_in_flight(batch_id: str) -> str:
    """hash: line index -> the job answering it ("pending" between reserving the line and submitting it)."""
    return f"{PREFIX}batch-in-flight:{batch_id}"


def batch_lease(batch_id: str) -> str:
    return f"{PREFIX}batch-lease:{batch_id}"


def owner_batches(owner: str) -> str:
    return f"{PREFIX}batches-of:{owner}"


def response(response_id: str) -> str:
    return f"{PREFIX}response:{response_id}"


def unstored_response(response_id: str) -> str:
    """string: the owner of a response made with `store: false`, kept only to say it cannot be continued."""
    return f"{PREFIX}response-unstored:{response_id}"


def tokenizer_calls(model: str) -> str:
    """list: tokenize/detokenize calls for any worker of the model (JSON, pushed left, popped right)."""
    return f"{PREFIX}tokenizer-calls:{model}"


def tokenizer_reply(call_id: str) -> str:
    return f"{PREFIX}tokenizer-reply:{call_id}"
