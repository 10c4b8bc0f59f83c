"""The job state machine in Redis: every transition is one atomic Lua script.

A model's queue is a sorted set of job ids scored by submission time. A worker claims a job by
moving it to the model's lease set, scored by the lease's expiry; its heartbeat pushes that
expiry forward. A lease that runs out (the worker died) puts the job back at the head of the
queue, where any worker of the model resumes it. Writes to a job's stream and record are fenced
by the attempt number, so a worker that lost its lease can never write into the job again.
The job itself is stored in arq's format (``arq:job:<id>``, JSON-serialized).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from arq.jobs import deserialize_job_raw, serialize_job
from redis.asyncio import Redis

from common import keys
from common.events import done_entry, error_entry, status_entry
from common.wire import JobSpec, JobStatus

GENERATE = "generate"

_SUBMIT = """
-- KEYS: record, events, arq job, queue, idempotency (or ''), queued tokens, owner's active jobs, owner's jobs
-- ARGV: id, ttl_s, now_ms, max queued jobs, arq payload, wake channel, cost, max queued tokens,
--       owner's max active jobs (0: no limit), n record fields, fields..., n event fields, fields...
if KEYS[5] ~= '' then
  local existing = redis.call('GET', KEYS[5])
  if existing then return {'duplicate', existing} end
end
local horizon = tonumber(ARGV[3]) - tonumber(ARGV[2]) * 1000
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', horizon)
local max_active = tonumber(ARGV[9])
if max_active > 0 and redis.call('ZCARD', KEYS[7]) >= max_active then return {'busy', ''} end
if redis.call('ZCARD', KEYS[4]) >= tonumber(ARGV[4]) then return {'full', 'jobs'} end
local cost = tonumber(ARGV[7])
local queued = tonumber(redis.call('GET', KEYS[6]) or '0')
if queued > 0 and queued + cost > tonumber(ARGV[8]) then return {'full', 'tokens'} end
local ttl = tonumber(ARGV[2])
local n = tonumber(ARGV[10])
local rec = {}
for i = 11, 10 + 2 * n do rec[#rec + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(rec))
redis.call('EXPIRE', KEYS[1], ttl)
local at = 11 + 2 * n
local m = tonumber(ARGV[at])
local ev = {}
for i = at + 1, at + 2 * m do ev[#ev + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(ev))
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('SET', KEYS[3], ARGV[5], 'EX', ttl)
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
redis.call('INCRBY', KEYS[6], cost)
redis.call('EXPIRE', KEYS[6], ttl)
redis.call('ZADD', KEYS[7], ARGV[3], ARGV[1])
redis.call('EXPIRE', KEYS[7], ttl)
redis.call('ZREMRANGEBYSCORE', KEYS[8], '-inf', horizon)
redis.call('ZADD', KEYS[8], ARGV[3], ARGV[1])
redis.call('EXPIRE', KEYS[8], ttl)
if KEYS[5] ~= '' then redis.call('SET', KEYS[5], ARGV[1], 'EX', ttl) end
redis.call('PUBLISH', ARGV[6], ARGV[1])
return {'created', ARGV[1]}
"""

# A job's cost leaves the model's queued-token count when it first starts, expires or is cancelled.
_UNCOUNT = """
local function uncount(counter, rec)
  local cost = tonumber(redis.call('HGET', rec, 'cost') or '0')
  if cost > 0 and redis.call('DECRBY', counter, cost) < 0 then redis.call('SET', counter, 0) end
end
"""

# A job leaves its owner's active set when it ends, however it ends.
_RELEASE_OWNER = """
local function release_owner(rec, id)
  local owner = redis.call('HGET', rec, 'owner')
  if owner then redis.call('ZREM', 'ortfleet:active:' .. owner, id) end
end
"""

_CANCEL = (
    _UNCOUNT
    + _RELEASE_OWNER
    + """
-- KEYS: record, queue, events, arq job, queued tokens
-- ARGV: id, now, cancel channel, n event fields, fields...
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 'missing' end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'attempts') == '0' then uncount(KEYS[5], KEYS[1]) end
  release_owner(KEYS[1], ARGV[1])
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finish_reason', 'cancelled', 'finished_at', ARGV[2])
  local ev = {}
  for i = 5, 4 + 2 * tonumber(ARGV[4]) do ev[#ev + 1] = ARGV[i] end
  redis.call('XADD', KEYS[3], '*', unpack(ev))
  redis.call('DEL', KEYS[4])
  return 'cancelled'
end
if st == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  redis.call('PUBLISH', ARGV[3], ARGV[1])
  return 'cancelling'
end
return st
"""
)

_CLAIM = (
    _UNCOUNT
    + _RELEASE_OWNER
    + """
-- KEYS: queue, leases, queued tokens; ARGV: now_ms, lease_ms, max jobs, worker id
local now = tonumber(ARGV[1])
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZADD', KEYS[1], 0, id)
end
local out = {}
local taken = 0
while taken < tonumber(ARGV[3]) do
  local head = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #head == 0 then break end
  local id = head[1]
  redis.call('ZREM', KEYS[1], id)
  local rec = 'ortfleet:job:' .. id
  local st = redis.call('HGET', rec, 'status')
  local first = redis.call('HGET', rec, 'attempts') == '0'
  if first then uncount(KEYS[3], rec) end
  local deadline = tonumber(redis.call('HGET', rec, 'deadline_ms') or '0')
  if first and st == 'queued' and deadline > 0 and now > deadline then
    local created = tonumber(redis.call('HGET', rec, 'created_at'))
    local waited = string.format('%.1f', (now - created * 1000) / 1000)
    local message = 'expired in queue: waited ' .. waited .. ' s, past the queue deadline'
    redis.call('HSET', rec, 'status', 'failed', 'finish_reason', 'error', 'error', message,
      'error_code', 'expired_in_queue', 'finished_at', now / 1000)
    redis.call('XADD', 'ortfleet:events:' .. id, '*', 'type', 'error', 'status', 'failed', 'message', message,
      'code', 'expired_in_queue')
    redis.call('DEL', 'arq:job:' .. id)
    release_owner(rec, id)
  elseif st == 'queued' or st == 'running' then
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), id)
    local attempt = redis.call('HINCRBY', rec, 'attempts', 1)
    redis.call('HSET', rec, 'status', 'running', 'worker', ARGV[4], 'started_at', now / 1000)
    local payload = redis.call('GET', 'arq:job:' .. id) or ''
    out[#out + 1] = id
    out[#out + 1] = attempt
    out[#out + 1] = payload
    taken = taken + 1
  end
end
return out
"""
)

_PUBLISH = """
-- KEYS: record, events
-- ARGV: attempt, n record fields, fields..., n entries, then per entry: n fields, fields...
if redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return -1 end
local nrec = tonumber(ARGV[2])
if nrec > 0 then
  local rec = {}
  for i = 3, 2 + 2 * nrec do rec[#rec + 1] = ARGV[i] end
  redis.call('HSET', KEYS[1], unpack(rec))
end
local count_at = 3 + 2 * nrec
local at = count_at + 1
local written = 0
for _ = 1, tonumber(ARGV[count_at]) do
  local n = tonumber(ARGV[at])
  local ev = {}
  for i = at + 1, at + 2 * n do ev[#ev + 1] = ARGV[i] end
  redis.call('XADD', KEYS[2], '*', unpack(ev))
  at = at + 1 + 2 * n
  written = written + 1
end
return written
"""

_FINISH = (
    _RELEASE_OWNER
    + """
-- KEYS: record, events, leases, arq job
-- ARGV: attempt, id, ttl_s, n record fields, fields..., n event fields, fields...
if redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[4])
local rec = {}
for i = 5, 4 + 2 * n do rec[#rec + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(rec))
local at = 5 + 2 * n
local ev = {}
for i = at + 1, at + 2 * tonumber(ARGV[at]) do ev[#ev + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(ev))
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[4])
release_owner(KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""
)

_PURGE = (
    _UNCOUNT
    + _RELEASE_OWNER
    + """
-- KEYS: record, events, arq job, queue, leases, queued tokens; ARGV: id, cancel channel
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 0 end
if redis.call('ZREM', KEYS[4], ARGV[1]) == 1 and redis.call('HGET', KEYS[1], 'attempts') == '0' then
  uncount(KEYS[6], KEYS[1])
end
release_owner(KEYS[1], ARGV[1])
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner then redis.call('ZREM', 'ortfleet:jobs-of:' .. owner, ARGV[1]) end
local idem = redis.call('HGET', KEYS[1], 'idempotency_key')
if idem then redis.call('DEL', idem) end
if redis.call('ZREM', KEYS[5], ARGV[1]) == 1 then redis.call('PUBLISH', ARGV[2], ARGV[1]) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
"""
)

_RELEASE = """
-- KEYS: queue, leases; ARGV: id
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then redis.call('ZADD', KEYS[1], 0, ARGV[1]) return 1 end
return 0
"""


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


@dataclass(frozen=True)
class Claim:
    job_id: str
    attempt: int
    payload: str


class OwnerBusy(Exception):
    def __init__(self, owner: str, limit: int) -> None:
        super().__init__(f"key {owner!r} has {limit} active jobs, its limit; wait for one to end")
        self.owner = owner
        self.limit = limit


@dataclass(frozen=True)
class QueueLimits:
    max_jobs: int
    max_tokens: int  # prompt and generated tokens of the jobs waiting, estimated at submission
    max_wait_s: float  # a job still queued after this fails as expired; 0 waits forever


@dataclass(frozen=True)
class Submitted:
    job_id: str
    created: bool


class QueueFull(Exception):
    def __init__(self, model: str, limit: str) -> None:
        super().__init__(f"the queue of model {model!r} is full ({limit})")
        self.model = model
        self.limit = limit


class JobQueue:
    """Atomic job transitions shared by the gateway (submit, cancel) and workers (claim ... finish)."""

    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self._submit = redis.register_script(_SUBMIT)
        self._cancel = redis.register_script(_CANCEL)
        self._claim = redis.register_script(_CLAIM)
        self._publish = redis.register_script(_PUBLISH)
        self._finish = redis.register_script(_FINISH)
        self._release = redis.register_script(_RELEASE)
        self._purge = redis.register_script(_PURGE)

    async def submit(
        self,
        spec: JobSpec,
        record: dict[str, str],
        *,
        limits: QueueLimits,
        cost: int,
        idempotency_key: str | None = None,
        owner: str = "",
        owner_max_active: int = 0,
    ) -> Submitted:
        """Queue a job atomically; raises QueueFull when the model's queue is at one of its limits."""
        now_ms = int(spec.submitted_at * 1000)
        if limits.max_wait_s:
            record = {**record, "deadline_ms": str(now_ms + int(limits.max_wait_s * 1000))}
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
            *_flat(
                {
                    **record,
                    "cost": str(cost),
                    "owner": owner,
                    **({"idempotency_key": idempotency_key} if idempotency_key else {}),
                }
            ),
            *_flat(status_entry(JobStatus.queued)),
        ]
        script_keys = [
            keys.job(spec.id),
            keys.events(spec.id),
            keys.arq_job(spec.id),
            keys.queue(spec.model),
            idempotency_key or "",
            keys.queued_tokens(spec.model),
            keys.active_jobs(owner),
            keys.owner_jobs(owner),
        ]
        outcome, detail = await self._submit(keys=script_keys, args=args)
        if outcome == "busy":
            raise OwnerBusy(owner, owner_max_active)
        if outcome == "full":
            limit = f"{limits.max_jobs} jobs" if detail == "jobs" else f"{limits.max_tokens} queued tokens"
            raise QueueFull(spec.model, limit)
        job_id = detail
        return Submitted(job_id=job_id, created=outcome == "created")

    async def cancel(self, job_id: str, model: str) -> str:
        """'cancelled' (was queued), 'cancelling' (running, worker told), 'missing', or a terminal status."""
        done = done_entry(JobStatus.cancelled, "cancelled", None)
        result: str = await self._cancel(
            keys=[
                keys.job(job_id),
                keys.queue(model),
                keys.events(job_id),
                keys.arq_job(job_id),
                keys.queued_tokens(model),
            ],
            args=[job_id, str(time.time()), keys.CANCEL_CHANNEL, *_flat(done)],
        )
        return result

    async def purge(self, job_id: str, model: str) -> bool:
        """Delete every trace of the job now; a running job is told to stop and can write nothing more."""
        purged: int = await self._purge(
            keys=[
                keys.job(job_id),
                keys.events(job_id),
                keys.arq_job(job_id),
                keys.queue(model),
                keys.leases(model),
                keys.queued_tokens(model),
            ],
            args=[job_id, keys.CANCEL_CHANNEL],
        )
        return bool(purged)

    async def claim(self, model: str, worker_id: str, max_jobs: int, lease_s: float) -> list[Claim]:
        now_ms = int(time.time() * 1000)
        raw = await self._claim(
            keys=[keys.queue(model), keys.leases(model), keys.queued_tokens(model)],
            args=[str(now_ms), str(int(lease_s * 1000)), str(max_jobs), worker_id],
        )
        return [Claim(raw[i], int(raw[i + 1]), raw[i + 2]) for i in range(0, len(raw), 3)]

    async def renew_leases(self, model: str, job_ids: list[str], lease_s: float) -> None:
        if not job_ids:
            return
        expiry = int((time.time() + lease_s) * 1000)
        await self.redis.zadd(keys.leases(model), dict.fromkeys(job_ids, expiry), xx=True)

    async def release(self, model: str, job_id: str) -> bool:
        """Give a running job back to the head of its queue (a stopping worker's unfinished job)."""
        released = await self._release(keys=[keys.queue(model), keys.leases(model)], args=[job_id])
        if released:
            await self.redis.publish(keys.wake_channel(model), job_id)
        return bool(released)

    async def publish(
        self, job_id: str, attempt: int, entries: list[dict[str, str]], record: dict[str, str] | None = None
    ) -> bool:
        """Append entries to the job's stream (and set record fields); False once the attempt lost the job."""
        args = [str(attempt), *_flat(record or {}), str(len(entries))]
        for entry in entries:
            args += _flat(entry)
        written: int = await self._publish(keys=[keys.job(job_id), keys.events(job_id)], args=args)
        return written >= 0

    async def finish(
        self,
        job_id: str,
        model: str,
        attempt: int,
        record: dict[str, str],
        final_entry: dict[str, str],
    ) -> bool:
        done: int = await self._finish(
            keys=[keys.job(job_id), keys.events(job_id), keys.leases(model), keys.arq_job(job_id)],
            args=[str(attempt), job_id, str(self.ttl_s), *_flat(record), *_flat(final_entry)],
        )
        return bool(done)

    async def fail(
        self,
        job_id: str,
        model: str,
        attempt: int,
        message: str,
        fields: dict[str, str],
        code: str | None = None,
    ) -> bool:
        """Ends the job as failed; `code` (like `context_length_exceeded`) names the error for programs."""
        record = {
            "status": JobStatus.failed.value,
            "error": message,
            "finished_at": str(time.time()),
            **fields,
        }
        if code:
            record["error_code"] = code
        final = error_entry(JobStatus.failed, message, code)
        return await self.finish(job_id, model, attempt, record, final)
