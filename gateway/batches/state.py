"""A batch's durable state in Redis, and its transitions, each one atomic Lua script.

A batch is a record (status, counts, cursor), its lines in flight (line index -> job id), and its
output and error files' lines. Every write of a driver is fenced by the driver's lease token, and a
line is answered only by the script that removes it from the lines in flight, so however many
processes die or race, each line is fed once and answered once.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from redis.asyncio import Redis
from redis.exceptions import WatchError

from common import lua
from common.keys import Keyspace
from gateway.owned import newest_after

PENDING = "pending"  # a line reserved for feeding whose job may or may not exist yet


class BatchStatus(str, Enum):
    validating = "validating"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    failed = "failed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


ENDED = frozenset({BatchStatus.completed, BatchStatus.failed, BatchStatus.expired, BatchStatus.cancelled})


def new_batch_id() -> str:
    return "batch_" + secrets.token_urlsafe(18)


class MoveRefused(str, Enum):
    """Why set_status.lua did not move a batch (besides the status it has)."""

    lease = "lease"  # the caller is not the batch's driver any more
    missing = "missing"


AnswerFile = Literal["output", "error"]
"""Which of a batch's two result files a line's answer goes to."""


@dataclass(frozen=True)
class Moved:
    """A status move: done, or refused, saying why (or the status the batch has)."""

    refused: MoveRefused | BatchStatus | None = None

    @property
    def done(self) -> bool:
        return self.refused is None


@dataclass(frozen=True)
class ReservedLine:
    index: int
    line: str


@dataclass(frozen=True)
class Batch:
    fields: dict[str, str]

    @property
    def id(self) -> str:
        return self.fields["id"]

    @property
    def owner(self) -> str:
        return self.fields.get("owner", "")

    @property
    def status(self) -> BatchStatus:
        return BatchStatus(self.fields["status"])

    @property
    def input_file_id(self) -> str:
        return self.fields["input_file_id"]

    @property
    def endpoint(self) -> str:
        return self.fields["endpoint"]

    @property
    def output_file_id(self) -> str:
        return self.fields["output_file_id"]

    @property
    def error_file_id(self) -> str:
        return self.fields["error_file_id"]

    @property
    def outcome(self) -> BatchStatus:
        """What a finalizing or cancelling batch ends as."""
        return BatchStatus(self.fields.get("outcome", BatchStatus.completed.value))

    def number(self, name: str) -> int:
        return int(self.fields.get(name, "0"))

    def view(self) -> dict[str, Any]:
        """The batch as OpenAI shows it."""
        f = self.fields

        def at(name: str) -> int | None:
            raw = f.get(name)
            return int(float(raw)) if raw else None

        status = self.status
        ended = status in ENDED
        errors = json.loads(f["errors"]) if f.get("errors") else None
        shown = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": f.get("completion_window", "24h"),
            "status": status.value,
            "output_file_id": self.output_file_id if ended and self.number("completed") else None,
            "error_file_id": self.error_file_id if ended and self.number("failed") else None,
            "created_at": at("created_at"),
            "in_progress_at": at("in_progress_at"),
            "expires_at": at("expires_at"),
            "finalizing_at": at("finalizing_at"),
            "completed_at": at("completed_at"),
            "failed_at": at("failed_at"),
            "expired_at": at("expired_at"),
            "cancelling_at": at("cancelling_at"),
            "cancelled_at": at("cancelled_at"),
            "request_counts": {
                "total": self.number("total"),
                "completed": self.number("completed"),
                "failed": self.number("failed"),
            },
            "metadata": json.loads(f["metadata"]) if f.get("metadata") else None,
        }
        # What has not happened (yet) is left out, as OpenAI's document has these fields: never null.
        return {key: value for key, value in shown.items() if value is not None or key == "metadata"}


class BatchState:
    """The batch records and their transitions; shared by the routes (create, cancel) and the drivers."""

    def __init__(self, redis: Redis, keys: Keyspace, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._lease = lua.register(redis, __name__, "lease.lua")
        self._set_status = lua.register(redis, __name__, "set_status.lua")
        self._reserve = lua.register(redis, __name__, "reserve.lua")
        self._started = lua.register(redis, __name__, "started.lua")
        self._answer = lua.register(redis, __name__, "answer.lua")

    async def create(self, fields: dict[str, str], expires_at: float) -> Batch | None:
        """Writes the batch and keeps its input file as long as the batch may read it, in one transaction
        with the check that the file is still there (None when it is gone): a file deleted meanwhile
        makes it look again, and FileStore.delete, which watches the active batches, refuses a file that
        an active batch reads."""
        ttl = int(expires_at - time.time()) + self.ttl_s
        batch_id = fields["id"]
        owner = fields.get("owner", "")
        source = self.keys.file(fields["input_file_id"])
        source_lines = self.keys.file_lines(fields["input_file_id"])
        created_ms = int(float(fields["created_at"]) * 1000)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(source)
                    if not await pipe.exists(source):
                        return None
                    held = [await pipe.ttl(source), await pipe.ttl(source_lines)]
                    pipe.multi()  # type: ignore[no-untyped-call]
                    for key, left in zip((source, source_lines), held, strict=True):
                        if left < ttl:
                            pipe.expire(key, ttl)
                    pipe.hset(source, "expires_at", str(int(expires_at) + self.ttl_s))
                    pipe.hset(self.keys.batch(batch_id), mapping=fields)
                    pipe.expire(self.keys.batch(batch_id), ttl)
                    pipe.zadd(self.keys.owner_batches(owner), {batch_id: created_ms})
                    pipe.expire(self.keys.owner_batches(owner), ttl)
                    pipe.zadd(self.keys.batches_active, {batch_id: created_ms})
                    await pipe.execute()
                    return Batch(fields)
                except WatchError:
                    continue

    async def load(self, batch_id: str) -> Batch | None:
        fields: dict[str, str] = await self.redis.hgetall(self.keys.batch(batch_id))  # type: ignore[misc]
        return Batch(fields) if fields else None

    async def take_lease(self, batch_id: str, *, token: str, lease_s: float) -> bool:
        held: int = await self._lease(
            keys=[self.keys.batch_lease(batch_id)], args=[token, int(lease_s * 1000)]
        )
        return bool(held)

    async def drop_lease(self, batch_id: str, *, token: str) -> None:
        if await self.redis.get(self.keys.batch_lease(batch_id)) == token:
            await self.redis.delete(self.keys.batch_lease(batch_id))

    async def move(
        self,
        batch_id: str,
        *,
        from_statuses: set[BatchStatus],
        to: BatchStatus,
        fields: dict[str, str] | None = None,
        token: str | None = None,
    ) -> Moved:
        """Moves the batch to `to` when its status is one of `from_statuses` (and, with `token`, the caller
        still holds its lease)."""
        lease = [self.keys.batch_lease(batch_id)] if token is not None else []
        reply: str = await self._set_status(
            keys=[self.keys.batch(batch_id), *lease],
            args=[
                token or "",
                ",".join(s.value for s in from_statuses),
                to.value,
                *lua.flat_fields(fields or {}),
            ],
        )
        if reply == "ok":
            return Moved()
        refused = MoveRefused(reply) if reply in MoveRefused.__members__ else BatchStatus(reply)
        return Moved(refused)

    async def reserve(
        self, batch: Batch, *, token: str, status: BatchStatus = BatchStatus.in_progress
    ) -> ReservedLine | None:
        """The next line to feed, now in flight as pending; None when every line has been fed (or the
        batch's status is no longer `status`)."""
        reply = await self._reserve(
            keys=[
                self.keys.batch(batch.id),
                self.keys.batch_lease(batch.id),
                self.keys.batch_in_flight(batch.id),
                self.keys.file_lines(batch.input_file_id),
            ],
            args=[token, status.value],
        )
        if not reply:
            return None
        index, line = reply
        return ReservedLine(int(index), str(line))

    async def started(self, batch_id: str, *, index: int, job_id: str) -> bool:
        done: int = await self._started(keys=[self.keys.batch_in_flight(batch_id)], args=[index, job_id])
        return bool(done)

    async def in_flight(self, batch_id: str) -> dict[int, str]:
        raw: dict[str, str] = await self.redis.hgetall(self.keys.batch_in_flight(batch_id))  # type: ignore[misc]
        return {int(index): job for index, job in raw.items()}

    async def answer(self, batch: Batch, *, index: int, expected: str, kind: AnswerFile, line: str) -> bool:
        """Writes the line's answer to the output ('output') or error ('error') file, once: False when
        the line is no longer in flight with the `expected` job (or 'pending')."""
        done: int = await self._answer(
            keys=[
                self.keys.batch(batch.id),
                self.keys.batch_in_flight(batch.id),
                self.keys.file_lines(batch.output_file_id),
                self.keys.file_lines(batch.error_file_id),
            ],
            args=[index, expected, kind, line, self.ttl_s],
        )
        return bool(done)

    async def active(self) -> list[str]:
        ids: list[str] = await self.redis.zrange(self.keys.batches_active, 0, -1)
        return ids

    async def retire(self, batch_id: str) -> None:
        await self.redis.zrem(self.keys.batches_active, batch_id)
        await self.redis.delete(self.keys.batch_in_flight(batch_id))

    async def list_batches(self, owner: str, limit: int, after: str | None) -> list[Batch]:
        ids = await newest_after(self.redis, self.keys.owner_batches(owner), after, 0, limit)
        found = []
        for batch_id in ids:
            batch = await self.load(batch_id)
            if batch is not None and batch.owner == owner:
                found.append(batch)
        return found
