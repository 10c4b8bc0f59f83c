"""Files in Redis: a record per file and its lines in a list, owned by the key that made them."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from common import lua
from common.keys import Keyspace
from gateway.files.quota import FileQuota
from gateway.owned import newest_after

READ_CHUNK_LINES = 1000
PURPOSES = ("batch",)  # what clients may upload; batch_output is what batches write
# How long the lines of an upload, and the bytes held for it, outlive its last write while it arrives:
# an upload its gateway stopped reading (it died) leaves nothing behind for long.
ARRIVING_TTL_S = 600


class FileInUse(Exception):
    def __init__(self, file_id: str, batch_id: str) -> None:
        super().__init__(f"file {file_id!r} is the input of batch {batch_id}, which has not ended")
        self.file_id = file_id
        self.batch_id = batch_id


def new_file_id() -> str:
    return "file-" + secrets.token_urlsafe(18)


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    lines: int
    created_at: int
    expires_at: int

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> StoredFile:
        return cls(
            id=fields["id"],
            owner=fields.get("owner", ""),
            purpose=fields["purpose"],
            filename=fields.get("filename", ""),
            bytes=int(fields.get("bytes", "0")),
            lines=int(fields.get("lines", "0")),
            created_at=int(fields["created_at"]),
            expires_at=int(fields["expires_at"]),
        )

    def view(self) -> dict[str, Any]:
        """The file as OpenAI shows it."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
        }


class FileStore:
    """Every gateway reads and writes the same files; a file and its lines expire together. `quota`
    counts what each owner keeps (none: counted, never refused)."""

    def __init__(self, redis: Redis, keys: Keyspace, ttl_s: int, quota: FileQuota | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.quota = quota or FileQuota(redis, keys)
        self._delete = lua.register(redis, __name__, "delete.lua")

    async def hold(self, owner: str, file_id: str, size: int) -> None:
        """Counts `size` bytes for the upload of `file_id` among what `owner` keeps, before they are
        written; raises OverQuota when that would pass the owner's limits."""
        await self.quota.hold(owner, file_id, size, time.time() + ARRIVING_TTL_S)

    async def append_lines(self, file_id: str, lines: list[bytes]) -> None:
        if lines:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(self.keys.file_lines(file_id), *lines)
                pipe.expire(self.keys.file_lines(file_id), ARRIVING_TTL_S)
                await pipe.execute()

    async def discard(self, owner: str, file_id: str) -> None:
        """Deletes the lines of an upload that failed, and what was held for it."""
        await self.redis.delete(self.keys.file_lines(file_id))
        await self.quota.release(owner, file_id)

    async def register(
        self, file_id: str, owner: str, purpose: str, filename: str, size: int, lines: int
    ) -> StoredFile:
        """Makes the file (whose lines are already stored) visible to its owner."""
        now = int(time.time())
        stored = StoredFile(file_id, owner, purpose, filename, size, lines, now, now + self.ttl_s)
        fields = {
            "id": file_id,
            "owner": owner,
            "purpose": purpose,
            "filename": filename,
            "bytes": str(size),
            "lines": str(lines),
            "created_at": str(now),
            "expires_at": str(stored.expires_at),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.file(file_id), mapping=fields)
            pipe.expire(self.keys.file(file_id), self.ttl_s)
            pipe.expire(self.keys.file_lines(file_id), self.ttl_s)
            pipe.zadd(self.keys.owner_files(owner), {file_id: now})
            pipe.expire(self.keys.owner_files(owner), self.ttl_s)
            await self.quota.settle(owner, file_id, size, time.time() + self.ttl_s, pipe)  # as its keys
            await pipe.execute()
        return stored

    async def get(self, file_id: str, owner: str) -> StoredFile | None:
        """The file if `owner` made it; another key's file does not exist for them."""
        fields: dict[str, str] = await self.redis.hgetall(self.keys.file(file_id))  # type: ignore[misc]
        if not fields or fields.get("owner", "") != owner:
            return None
        return StoredFile.from_fields(fields)

    async def list_files(
        self, owner: str, purpose: str | None, limit: int, after: str | None
    ) -> list[StoredFile]:
        """The owner's files, newest first, after the file `after` (files of the same second too)."""
        found: list[StoredFile] = []
        offset = 0
        while len(found) < limit:
            ids = await newest_after(self.redis, self.keys.owner_files(owner), after, offset, limit * 2)
            if not ids:
                break
            offset += len(ids)
            for file_id in ids:
                stored = await self.get(file_id, owner)
                if stored is None:  # expired: out of the index, and out of the count of those passed
                    await self.redis.zrem(self.keys.owner_files(owner), file_id)
                    offset -= 1
                elif purpose is None or stored.purpose == purpose:
                    found.append(stored)
        return found[:limit]

    async def batch_reading(self, file_id: str) -> str | None:
        """The id of a batch not yet ended whose input is the file, if any: it reads its lines until it
        ends."""
        batch_ids: list[str] = await self.redis.zrange(self.keys.batches_active, 0, -1)
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hget(self.keys.batch(batch_id), "input_file_id")
            inputs: list[str | None] = await pipe.execute()
        return next((b for b, source in zip(batch_ids, inputs, strict=True) if source == file_id), None)

    async def delete(self, file_id: str, owner: str) -> bool:
        """Deletes the owner's file (False: it has none of that id); raises FileInUse while a batch that has
        not ended reads it. The delete (scripts/delete.lua) checks that the batches not yet ended are those
        read before the check: a batch created or ended between them (BatchState.create watches the file)
        makes it look again. It works on a Redis out of memory, to which it gives memory back."""
        while True:
            active: list[str] = await self.redis.zrange(self.keys.batches_active, 0, -1)
            if await self.get(file_id, owner) is None:
                return False
            if (reader := await self.batch_reading(file_id)) is not None:
                raise FileInUse(file_id, reader)
            file_keys = [self.keys.file(file_id), self.keys.file_lines(file_id), self.keys.owner_files(owner)]
            outcome = await self._delete(
                keys=[*self.keys.file_quota(owner), *file_keys, self.keys.batches_active],
                args=[int(time.time() * 1000), file_id, owner, *active],
            )
            if int(outcome) >= 0:
                return bool(outcome)

    async def line_count(self, file_id: str) -> int:
        count: int = await self.redis.llen(self.keys.file_lines(file_id))  # type: ignore[misc]
        return count

    async def read_lines(self, file_id: str, start: int, count: int) -> list[str]:
        lines: list[str] = await self.redis.lrange(self.keys.file_lines(file_id), start, start + count - 1)  # type: ignore[misc]
        return lines

    async def content(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, a thousand lines at a time."""
        start = 0
        while True:
            lines = await self.read_lines(file_id, start, READ_CHUNK_LINES)
            if not lines:
                return
            yield "".join(lines).encode()
            start += len(lines)
