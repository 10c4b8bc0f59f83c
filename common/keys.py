"""Every Redis key and channel ortfleet names, and the functions that derive them.

A `Keyspace` names the keys of one store (a model's queues, fair share, leases, job records and
streams, its workers' registry, its share of each API key's counters) or of the fleet's home data (API
keys' rate limits, files, batches, responses). On one Redis the names carry no tag, and the home data
and every store of that Redis share one keyspace (`STANDALONE`). On a Redis Cluster each keyspace
carries a hash tag of its own (`ortfleet:{tag}:...`), so all of its keys hash to one slot: every script,
transaction and multi-key command of a store stays on one node, and a model's stores spread over the
primaries by their tags (`store_tag`).

The Lua scripts (common/jobs/scripts/, gateway/) build no key names: their wrappers derive every key
here and pass it in KEYS.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from arq.constants import job_key_prefix as _arq_job_prefix
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

ARQ_JOB_PREFIX: str = _arq_job_prefix

PREFIX = "ortfleet:"
HOME_TAG = "home"  # the home data's tag on a Redis Cluster


class JobKeys(NamedTuple):
    """The keys of one job, all derived from its id."""

    record: str
    events: str
    arq_job: str


class FileQuotaKeys(NamedTuple):
    """What one key keeps in files (gateway/files/quota.py), each living as long as its latest file."""

    sizes: str  # hash: file id -> bytes (a file still arriving: those held for it)
    expiries: str  # zset: file id -> its expiry (ms)
    total: str  # string: the sum of the sizes


_UNTAGGABLE = re.compile(r"[{}\s]")


def store_tag(model: str, index: int, stores: int) -> str:
    """The hash tag of store `index` (0-based) of a model's `stores` on a Redis Cluster: the model's name
    and the store's number, with a suffix chosen so that its slot lies in the index-th of `stores` equal
    ranges of the slot space. A cluster whose primaries split the slots evenly (as a new one does) thus
    holds each of up to that many stores on a primary of its own; the tag depends on nothing else, so
    every gateway and worker derives the same one."""
    base = f"{_UNTAGGABLE.sub('_', model)}#{index + 1}"
    suffix = 0
    while True:
        tag = base if suffix == 0 else f"{base}.{suffix}"
        if key_slot(tag.encode()) * stores // REDIS_CLUSTER_HASH_SLOTS == index:
            return tag
        suffix += 1


class Keyspace:
    """The keys and channels of one keyspace; `tag` None for one Redis (names without a hash tag)."""

    def __init__(self, tag: str | None = None) -> None:
        if tag is not None and (not tag or _UNTAGGABLE.search(tag)):
            raise ValueError(f"a hash tag must be non-empty, without braces or spaces: {tag!r}")
        self.tag = tag
        self.prefix = prefix = PREFIX if tag is None else f"{PREFIX}{{{tag}}}:"
        self._arq_prefix = ARQ_JOB_PREFIX if tag is None else f"{ARQ_JOB_PREFIX}{{{tag}}}:"
        self.workers = prefix + "workers"  # zset: worker id -> heartbeat expiry (ms)
        self.models = prefix + "models"  # hash: model name -> JSON of what its workers last reported
        self.cancel_channel = prefix + "cancel"  # pub/sub: job ids whose running generation must stop
        self.stream_notices = prefix + "stream-notices"  # pub/sub: job stream keys just added to
        # string: this store's data epoch (common/store_epoch.py); job TTL, renewed by reads
        self.epoch = prefix + "epoch"
        self.queue_deadlines = prefix + "queue-deadlines"  # zset: queued job id -> its deadline (ms)
        # set: epochs whose data this store lost (restarted empty); job TTL
        self.lost_epochs = prefix + "lost-epochs"
        # zset: batch id -> creation time (ms), while a driver owes it work (home data)
        self.batches_active = prefix + "batches:active"
        self.events_prefix = prefix + "events:"

    def __repr__(self) -> str:
        return f"Keyspace({self.tag!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keyspace) and other.tag == self.tag

    def __hash__(self) -> int:
        return hash(self.tag)

    @property
    def shown(self) -> str:
        """How messages name it: its tag in braces, or nothing on one Redis."""
        return "" if self.tag is None else f"{{{self.tag}}}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self.events_prefix}{job_id}"

    def arq_job(self, job_id: str) -> str:
        return self._arq_prefix + job_id

    def job_keys(self, job_id: str) -> JobKeys:
        return JobKeys(self.job(job_id), self.events(job_id), self.arq_job(job_id))

    def queue(self, model: str, priority: str = "interactive") -> str:
        """zset: the model's waiting jobs of one priority class -> their fair-share tag
        (common/jobs/scripts/fair.lua)."""
        if priority == "interactive":
            return f"{self.prefix}queue:{model}"
        return f"{self.prefix}queue:{model}:{priority}"

    def fair_tags(self, model: str, priority: str) -> str:
        """hash: per key of a model's priority class, the finish tag of its last job; ":v" the class's
        virtual time, ":seq" its submission counter (common/jobs/scripts/fair.lua)."""
        return f"{self.prefix}fair:{model}:{priority}"

    def preempting(self, model: str) -> str:
        """string: engine slots workers are freeing for the model's waiting interactive jobs (short-lived)."""
        return f"{self.prefix}preempting:{model}"

    def served_tokens(self, model: str) -> str:
        """hash: "<class>" and "<class>:<key>" -> tokens served (prompt and generated) by finished jobs;
        it expires a job TTL after the last one."""
        return f"{self.prefix}served:{model}"

    def leases(self, model: str) -> str:
        return f"{self.prefix}leases:{model}"

    def queued_tokens(self, model: str) -> str:
        return f"{self.prefix}queued-tokens:{model}"

    def finished(self, model: str) -> str:
        """zset: "<status>:<job id>" of jobs that ended (on a worker or in the queue) -> end time (ms),
        last minute only."""
        return f"{self.prefix}finished:{model}"

    def request_rate(self, owner: str) -> str:
        return f"{self.prefix}rate:{owner}"

    def tokenize_budget(self, owner: str) -> str:
        """string: when the key's /tokenize budget is full again (ms; the rate limit's theoretical
        arrival)."""
        return f"{self.prefix}tokenize-budget:{owner}"

    def active_jobs(self, owner: str) -> str:
        return f"{self.prefix}active:{owner}"

    def prompt_tokens_in_flight(self, owner: str) -> str:
        """hash: the estimated prompt tokens of each of the key's active jobs (those in active_jobs) by
        job id, and ":total" their sum; the estimated bytes of each one's stream under "bytes:" and its
        id, and ":bytes" their sum (the job scripts charge and release both with the job's state)."""
        return f"{self.prefix}prompt-tokens:{owner}"

    def owner_jobs(self, owner: str) -> str:
        """zset: every job of the owner -> its submission (ms), while its record lives: listing and
        ownership."""
        return f"{self.prefix}jobs-of:{owner}"

    def owner_ended_jobs(self, owner: str) -> str:
        """zset: the owner's jobs that ended -> their end (ms): a submission drops from owner_jobs those that
        ended a job TTL ago (their records expired), and never a queued or running one."""
        return f"{self.prefix}ended-of:{owner}"

    def wake_channel(self, model: str) -> str:
        return f"{self.prefix}wake:{model}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    def prefix_hint(self, model: str, digest: str) -> str:
        """The worker that holds the prompt KV of a chat's leading messages (common/prefix_hints.py)."""
        return f"{self.prefix}prefix-hint:{model}:{digest}"

    def idempotency(self, digest: str) -> str:
        return f"{self.prefix}idem:{digest}"

    def idempotency_try(self, digest: str) -> str:
        """string, on the key's home store of a model with several: a token of the gateway whose try
        of the key
        is in flight, so that tries of one key go one at a time (gateway/idempotency.py); short-lived."""
        return f"{self.idempotency(digest)}:trying"

    def idempotency_tries(self, digest: str) -> str:
        """set, on the key's home store of a model with several (gateway/placement.py's key_home): the other
        stores a try of the key went to, by label; job TTL."""
        return f"{self.idempotency(digest)}:tried"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}"

    def file_lines(self, file_id: str) -> str:
        """list: the file's lines, each with its line break, in order."""
        return f"{self.prefix}file-lines:{file_id}"

    def owner_files(self, owner: str) -> str:
        return f"{self.prefix}files-of:{owner}"

    def file_quota(self, owner: str) -> FileQuotaKeys:
        return FileQuotaKeys(
            f"{self.prefix}file-sizes:{owner}",
            f"{self.prefix}file-expiries:{owner}",
            f"{self.prefix}file-bytes:{owner}",
        )

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}"

    def batch_in_flight(self, batch_id: str) -> str:
        """hash: line index -> the job answering it ("pending" between reserving the line and
        submitting it)."""
        return f"{self.prefix}batch-in-flight:{batch_id}"

    def batch_lease(self, batch_id: str) -> str:
        return f"{self.prefix}batch-lease:{batch_id}"

    def owner_batches(self, owner: str) -> str:
        return f"{self.prefix}batches-of:{owner}"

    def response(self, response_id: str) -> str:
        return f"{self.prefix}response:{response_id}"

    def unstored_response(self, response_id: str) -> str:
        """string: the owner of a response made with `store: false`, kept only to say it cannot be
        continued."""
        return f"{self.prefix}response-unstored:{response_id}"

    def tokenizer_calls(self, model: str) -> str:
        """list: tokenize/detokenize calls for any worker of the model (JSON, pushed left, popped right)."""
        return f"{self.prefix}tokenizer-calls:{model}"

    def tokenizer_reply(self, call_id: str) -> str:
        return f"{self.prefix}tokenizer-reply:{call_id}"

    def runtime_adapters(self, model: str) -> str:
        """hash: the model's LoRA adapters loaded at run time, name -> folder (common/adapter_calls.py)."""
        return f"{self.prefix}runtime-adapters:{model}"

    def adapter_calls(self, worker_id: str) -> str:
        """list: adapter loads and unloads for one worker (JSON, pushed left, popped right)."""
        return f"{self.prefix}adapter-calls:{worker_id}"

    def adapter_reply(self, call_id: str) -> str:
        """list: each worker's reply to an adapter call."""
        return f"{self.prefix}adapter-reply:{call_id}"


STANDALONE = Keyspace()  # one Redis: the names without a tag
