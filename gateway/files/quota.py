"""What each API key keeps in files, counted in Redis and capped (ORTFLEET_KEY_MAX_STORED_FILE_BYTES,
ORTFLEET_KEY_MAX_STORED_FILES), so that one key's uploads cannot fill the Redis every key shares.

Each file of a key is counted with its bytes and its expiry (scripts/hold.lua): an upload holds its
Content-Length before its body is read, and more as its lines arrive past that; the file, once written,
counts its size until it is deleted or expires. A file whose expiry has passed leaves the count at the
key's next upload or delete, so the count never drifts from what Redis holds.
"""

from __future__ import annotations

import time
from typing import Literal

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from common import keys, lua

Limit = Literal["bytes", "files"]


class OverQuota(Exception):
    """The upload would take the key past one of its limits; it keeps `kept_bytes` in `kept_files`."""

    def __init__(self, owner: str, limit: Limit, most: int, kept_bytes: int, kept_files: int) -> None:
        who = f"key {owner!r}" if owner else "this gateway"
        if limit == "files":
            said = f"{who} keeps {kept_files} files, its most (ORTFLEET_KEY_MAX_STORED_FILES)"
        else:
            said = (
                f"{who} keeps {kept_bytes} bytes of files, and this upload would take it past its most, "
                f"{most} bytes (ORTFLEET_KEY_MAX_STORED_FILE_BYTES)"
            )
        super().__init__(said)
        self.owner = owner
        self.limit = limit
        self.most = most
        self.kept_bytes = kept_bytes
        self.kept_files = kept_files


class FileQuota:
    """The file counts of every key on one Redis; a limit of 0 is none."""

    def __init__(self, redis: Redis, max_bytes: int = 0, max_files: int = 0) -> None:
        self.redis = redis
        self.max_bytes = max_bytes
        self.max_files = max_files
        self._hold = lua.register(redis, __name__, "hold.lua")
        self._release = lua.register(redis, __name__, "release.lua")

    async def hold(self, owner: str, file_id: str, size: int, until_s: float) -> None:
        """Counts at least `size` bytes for the file, until `until_s` (renewed by each call); raises
        OverQuota, counting nothing more, when that would pass a limit of the key."""
        args = self._args(file_id, size, until_s, 0)
        reply = await self._hold(keys=list(keys.file_quota(owner)), args=args)
        if int(reply[0]) == 0:
            limit: Limit = "files" if reply[1] == "files" else "bytes"
            most = self.max_files if limit == "files" else self.max_bytes
            raise OverQuota(owner, limit, most, int(reply[2]), int(reply[3]))

    async def settle(self, owner: str, file_id: str, size: int, until_s: float, pipe: Pipeline) -> None:
        """Counts the written file at its size until it expires, whatever the limits (it is stored):
        queued on `pipe`, the transaction that makes the file."""
        await self._hold(
            keys=list(keys.file_quota(owner)), args=self._args(file_id, size, until_s, 1), client=pipe
        )

    def _args(self, file_id: str, size: int, until_s: float, exact: int) -> list[str | int]:
        return [_now_ms(), file_id, size, int(until_s * 1000), self.max_bytes, self.max_files, exact]

    async def release(self, owner: str, file_id: str) -> None:
        """The file no longer counts (its upload failed; a file deleted leaves in scripts/delete.lua)."""
        await self._release(keys=list(keys.file_quota(owner)), args=[_now_ms(), file_id])

    async def kept(self, owner: str) -> tuple[int, int]:
        """The bytes and the files the key keeps, as last counted (expired files may still be in)."""
        found = keys.file_quota(owner)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(found.total)
            pipe.hlen(found.sizes)
            total, files = await pipe.execute()
        return int(total or 0), int(files)


def _now_ms() -> int:
    return int(time.time() * 1000)
