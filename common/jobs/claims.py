"""Workers' claims on jobs (claim.lua) and their leases: renewal (renew.lua), release back to the queue
(release.lua), and the reservation of slots freed for interactive work (reserve_preemption.lua)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import IntEnum

from redis.asyncio import Redis

from common import lua
from common.error_codes import ErrorCode
from common.fleet_stats import RECENT_WINDOW_S
from common.jobs.payload import MalformedJob, parse_job_payload
from common.keys import Keyspace
from common.prefix_hints import leave_hints
from common.wire import PRIORITY_ORDER, ChatMessage, PriorityClass

# A claim looks at the queue again, up to this many times in all, when the claim script stops early:
# the head of the queue moved, or a job expired whose owner the claim did not look up (it looks up
# owners only then, since only an expired job's owner has keys to change).
_CLAIM_ROUNDS = 4
# A worker with a KV budget (claim.lua passes over the jobs that need more) looks this many jobs further
# into each class's queue.
KV_SKIP_SCAN = 32


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
    idempotency_key: str | None = None  # the Redis key of its idempotency entry: it expires with the job


@dataclass(frozen=True)
class Claimed:
    claims: list[Claim]
    suspect_waiting: bool  # a suspect job waits for a worker that runs nothing else


def claim_priority(claim: Claim) -> PriorityClass:
    """The class of a claimed job, from its payload (interactive when unreadable)."""
    try:
        return parse_job_payload(claim.payload).priority
    except MalformedJob:
        return PriorityClass.interactive


class ClaimStop(IntEnum):
    """Why claim.lua stopped before it took as many jobs as asked (its reply's first value)."""

    none = 0  # it did not: it took them, or the queues ran out, or a suspect job waits
    head_moved = 1  # the head of a queue is no candidate: look again
    owners_needed = 2  # a job expired whose owner the caller did not give: look again, with owners
    preferred_elsewhere = 3  # the head waits, for a little while, for the worker that holds its prompt's KV


@dataclass(frozen=True)
class ClaimReply:
    stop: ClaimStop
    suspect_waiting: bool
    claims: list[Claim]


@dataclass(frozen=True)
class Candidate:
    """A job a claim may take, with what the claim needs to end it (expired in its queue), once looked up."""

    owner: str
    idempotency_key: str | None


class ClaimScript:
    """claim.lua."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "claim.lua")

    async def __call__(
        self,
        *,
        model: str,
        worker_id: str,
        now_ms: int,
        lease_ms: int,
        wanted: int,
        idle: bool,
        ttl_s: int,
        kv_budget_tokens: int,  # 0: any job fits
        scan: int,
        candidates: dict[str, Candidate | None],  # job id -> its owner's, None when not looked up
        promised: frozenset[str] = frozenset(),  # candidates taken first, wherever they wait (owners known)
    ) -> ClaimReply:
        script_keys = [
            self.keys.leases(model),
            self.keys.queued_tokens(model),
            self.keys.finished(model),
            self.keys.queue_deadlines,
        ]
        for cls in PRIORITY_ORDER:
            script_keys += [self.keys.queue(model, cls.value), self.keys.fair_tags(model, cls.value)]
        args = [str(now_ms), str(lease_ms), str(wanted), worker_id, str(RECENT_WINDOW_S * 1000)]
        args += [ErrorCode.expired_in_queue.value, "1" if idle else "0", str(ttl_s)]
        args += [str(kv_budget_tokens), str(scan)]
        args += [str(len(PRIORITY_ORDER)), *(cls.value for cls in PRIORITY_ORDER), self.keys.stream_notices]
        for job_id, candidate in candidates.items():
            owner = candidate.owner if candidate is not None else ""
            idem = candidate.idempotency_key if candidate is not None else None
            script_keys += [
                *self.keys.job_keys(job_id),
                self.keys.active_jobs(owner),
                self.keys.prompt_tokens_in_flight(owner),
                self.keys.owner_jobs(owner),
                self.keys.owner_ended_jobs(owner),
                idem or self.keys.idempotency(""),  # a stand-in, never the record's
            ]
            first = "1" if job_id in promised and candidate is not None else "0"
            args += [job_id, owner, "1" if candidate is not None else "0", first]
        raw = await self._script(keys=script_keys, args=args)
        claims = [
            Claim(
                job_id=raw[i],
                attempt=int(raw[i + 1]),
                payload=raw[i + 2],
                model=model,
                owner=raw[i + 3],
                quarantined=raw[i + 4] == "1",
                quarantine_deaths=int(raw[i + 5]),
                idempotency_key=raw[i + 6] or None,
            )
            for i in range(2, len(raw), 7)
        ]
        return ClaimReply(ClaimStop(int(raw[0])), raw[1] == "1", claims)


class RenewScript:
    """renew.lua: how many of the leases the claims still held it pushed to `expiry_ms`."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "renew.lua")

    async def __call__(self, *, model: str, claims: list[Claim], expiry_ms: int) -> int:
        args = [str(expiry_ms)]
        for claim in claims:
            args += [claim.job_id, str(claim.attempt)]
        script_keys = [self.keys.leases(model), *(self.keys.job(claim.job_id) for claim in claims)]
        return int(await self._script(keys=script_keys, args=args))


class ReleaseScript:
    """release.lua: False when the claim no longer holds the job."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "release.lua")

    async def __call__(self, *, claim: Claim, priority: PriorityClass, preempted: bool) -> bool:
        released = await self._script(
            keys=[
                self.keys.queue(claim.model, priority.value),
                self.keys.leases(claim.model),
                self.keys.job(claim.job_id),
            ],
            args=[claim.job_id, str(claim.attempt), "1" if preempted else "0"],
        )
        return bool(released)


class ReservePreemptionScript:
    """reserve_preemption.lua: False when the slots other workers are freeing cover the waiting jobs."""

    def __init__(self, redis: Redis, keys: Keyspace) -> None:
        self.keys = keys
        self._script = lua.register(redis, __name__, "reserve_preemption.lua")

    async def __call__(self, *, model: str, slots: int, waiting: int, hold_s: float) -> bool:
        reserved = await self._script(
            keys=[self.keys.preempting(model)], args=[str(slots), str(waiting), str(int(hold_s * 1000))]
        )
        return bool(reserved)


class JobLeasing:
    """JobQueue's claims and leases."""

    keys: Keyspace
    _redis: Redis
    ttl_s: int
    _claim: ClaimScript
    _renew: RenewScript
    _release: ReleaseScript
    _reserve_preemption: ReservePreemptionScript

    async def claim(
        self,
        model: str,
        worker_id: str,
        max_jobs: int,
        lease_s: float,
        *,
        idle: bool = True,
        kv_budget_tokens: int = 0,
    ) -> list[Claim]:
        """Up to `max_jobs` jobs from the heads of the model's queues, highest class first (jobs whose
        lease ran out go back to their queue first)."""
        claimed = await self.claim_jobs(
            model, worker_id, max_jobs, lease_s, idle=idle, kv_budget_tokens=kv_budget_tokens
        )
        return claimed.claims

    async def claim_jobs(
        self,
        model: str,
        worker_id: str,
        max_jobs: int,
        lease_s: float,
        *,
        idle: bool = True,
        kv_budget_tokens: int = 0,
        promised: dict[str, str] | None = None,
    ) -> Claimed:
        """Up to `max_jobs` jobs from the heads of the model's queues, highest class first (jobs whose
        lease ran out go back to their queue first). `promised` jobs (id -> owner: another key's jobs
        for which the worker preempted a row) are taken first, wherever they wait in their queue. A
        suspect job (a worker died holding it) is taken only by an `idle` worker (it runs nothing), as
        the claim's only job; a claim stops at a suspect job it may not take, and says one waits. With
        `kv_budget_tokens`, jobs that need more KV tokens (prompt and max_tokens) are passed over, left
        to a worker with a larger budget."""
        scan_extra = KV_SKIP_SCAN if kv_budget_tokens > 0 else 0
        claims: list[Claim] = []
        suspect_waiting = False
        owners_needed = False
        promised = dict(promised or {})
        for _ in range(_CLAIM_ROUNDS):
            wanted = max_jobs - len(claims)
            if wanted <= 0:
                break
            now_ms = int(time.time() * 1000)
            heads = await self._claim_candidates(model, wanted + scan_extra, now_ms)
            ids = list(dict.fromkeys([*promised, *heads]))
            if not ids:
                break
            looked_up = ids if owners_needed else list(promised)  # a promised job's owner is always known
            owners = await self._candidates(looked_up) if looked_up else {}
            reply = await self._claim(
                model=model,
                worker_id=worker_id,
                now_ms=now_ms,
                lease_ms=int(lease_s * 1000),
                wanted=wanted,
                idle=idle and not claims,
                ttl_s=self.ttl_s,
                kv_budget_tokens=kv_budget_tokens,
                scan=wanted + scan_extra,
                candidates={job_id: owners.get(job_id) for job_id in ids},
                promised=frozenset(promised),
            )
            promised = {}  # taken, or no longer waiting
            claims += reply.claims
            suspect_waiting = reply.suspect_waiting
            if reply.stop is ClaimStop.preferred_elsewhere:
                break
            if reply.stop is ClaimStop.owners_needed:
                owners_needed = True
            elif reply.stop is not ClaimStop.head_moved or any(claim.quarantined for claim in reply.claims):
                break
        return Claimed(claims, suspect_waiting)

    async def _claim_candidates(self, model: str, wanted: int, now_ms: int) -> list[str]:
        """The jobs a claim may take: those whose lease ran out, then the head of each class's queue."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(self.keys.leases(model), "-inf", now_ms)
            for cls in PRIORITY_ORDER:
                pipe.zrange(self.keys.queue(model, cls.value), 0, wanted - 1)
            expired, *heads = await pipe.execute()
        return list(dict.fromkeys([*expired, *(job_id for head in heads for job_id in head)]))

    async def _candidates(self, job_ids: list[str]) -> dict[str, Candidate]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(self.keys.job(job_id), ["owner", "idempotency_key"])
            found = await pipe.execute()
        return {
            job_id: Candidate(owner or "", idem or None)
            for job_id, (owner, idem) in zip(job_ids, found, strict=True)
        }

    async def leave_prefix_hints(
        self, model: str, scope: str, messages: list[ChatMessage], worker_id: str
    ) -> None:
        """This worker holds the KV of these messages' prompt, for jobs of the cache scope
        (common/prefix_hints.py)."""
        await leave_hints(self._redis, self.keys, model, scope, messages, worker_id)

    async def renew_leases(self, claims: list[Claim], lease_s: float) -> int:
        """Push forward the leases of the jobs these claims still hold; returns how many."""
        renewed = 0
        for model in {claim.model for claim in claims}:
            held = [claim for claim in claims if claim.model == model]
            expiry_ms = int((time.time() + lease_s) * 1000)
            renewed += await self._renew(model=model, claims=held, expiry_ms=expiry_ms)
        return renewed

    async def release(self, claim: Claim, *, preempted: bool = False) -> bool:
        """Give a running job back to its queue, in its place (a stopping worker's unfinished job, or a
        preempted one); False when the claim no longer holds it."""
        released = await self._release(claim=claim, priority=claim_priority(claim), preempted=preempted)
        if released:
            await self._redis.publish(self.keys.wake_channel(claim.model), claim.job_id)
        return released

    async def reserve_preemption(self, model: str, slots: int, waiting: int, hold_s: float) -> bool:
        """Whether a worker may free `slots` for the `waiting` interactive jobs: False when the slots
        other workers are freeing cover them already. Reservations lapse after `hold_s`."""
        return await self._reserve_preemption(model=model, slots=slots, waiting=waiting, hold_s=hold_s)

    async def end_preemption(self, model: str, hold_s: float) -> None:
        """One reserved slot is free: its job is back in the queue, or ended before it stopped."""
        await self._reserve_preemption(model=model, slots=-1, waiting=0, hold_s=hold_s)
