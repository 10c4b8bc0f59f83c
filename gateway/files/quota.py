"""What each API key keeps in files, counted in Redis and capped (ORTFLEET_KEY_MAX_STORED_FILE_BYTES,
ORTFLEET_KEY_MAX_STORED_FILES), so that one key's uploads cannot fill the Redis every key shares.

Each file of a key is counted with its bytes and its expiry (scripts/hold.lua): an upload holds its
Content-Length before its body is read, and more as its lines arrive past that; the file, once written,
counts its size until it is deleted or expires. A file whose expiry has passed leaves the count at the
key's next upload or delete, so the count never drifts from what Redis holds.

Whoever uploads them, files may fill their Redis only to a share of its maxmemory
(ORTFLEET_FILES_MAX_MEMORY_SHARE), its memory read at each hold (every 256 KiB of an upload): the rest is
left to jobs.
"""

from __future__ import annotations

import time
from typing import Literal

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from common import lua
from common.keys import Keyspace

Limit = Literal["bytes", "files", "memory"]


class OverQuota(Exception):
    """The upload would take the key past one of its limits; it keeps `kept_bytes` in `kept_files`."""

    def __init__(self, owner: str, limit: Limit, most: int, kept_bytes: int, kept_files: int) -> None:
        who = f"key {owner!r}" if owner else "this gateway"
        if limit == "memory":
            said = (
                f"the Redis that keeps files holds {kept_bytes / 2**20:.1f} MiB, and uploads may fill it "
                f"only to {most / 2**20:.1f} MiB (ORTFLEET_FILES_MAX_MEMORY_SHARE of its maxmemory), "
                "leaving the rest to jobs"
            )
        elif limit == "files":
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

    def __init__(
        self,
        redis: Redis,
        keys: Keyspace,
        max_bytes: int = 0,
        max_files: int = 0,
        memory_share: float = 1.0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.memory_share = memory_share
        self._hold = lua.register(redis, __name__, "hold.lua")
        self._release = lua.register(redis, __name__, "release.lua")

    async def hold(self, owner: str, file_id: str, size: int, until_s: float) -> None:
        """Counts at least `size` bytes for the file, until `until_s` (renewed by each call); raises
        OverQuota, counting nothing more, when that would pass a limit of the key, or take the Redis past
        the share of its maxmemory that files may fill (the memory in use may count the part of this file
        written already: the check errs on the side of room for jobs)."""
        if self.memory_share < 1:
            await self._check_memory(owner, size)
        args = self._args(file_id, size, until_s, 0)
        reply = await self._hold(keys=list(self.keys.file_quota(owner)), args=args)
        if int(reply[0]) == 0:
            limit: Limit = "files" if reply[1] == "files" else "bytes"
            most = self.max_files if limit == "files" else self.max_bytes
            raise OverQuota(owner, limit, most, int(reply[2]), int(reply[3]))

    async def _check_memory(self, owner: str, size: int) -> None:
        try:
            info = await self.redis.info("memory")
        except ResponseError:  # INFO disabled (some managed Redis): nothing to compare with
            return
        used, maxmemory = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
        if maxmemory > 0 and used + size > self.memory_share * maxmemory:
            raise OverQuota(owner, "memory", int(self.memory_share * maxmemory), used, 0)

    async def settle(self, owner: str, file_id: str, size: int, until_s: float, pipe: Pipeline) -> None:
        """Counts the written file at its size until it expires, whatever the limits (it is stored):
        queued on `pipe`, the transaction that makes the file."""
        await self._hold(
            keys=list(self.keys.file_quota(owner)), args=self._args(file_id, size, until_s, 1), client=pipe
        )

    def _args(self, file_id: str, size: int, until_s: float, exact: int) -> list[str | int]:
        return [_now_ms(), file_id, size, int(until_s * 1000), self.max_bytes, self.max_files, exact]

    async def release(self, owner: str, file_id: str) -> None:
        """The file no longer counts (its upload failed; a file deleted leaves in scripts/delete.lua)."""
        await self._release(keys=list(self.keys.file_quota(owner)), args=[_now_ms(), file_id])

    async def kept(self, owner: str) -> tuple[int, int]:
        """The bytes and the files the key keeps, as last counted (expired files may still be in)."""
        found = self.keys.file_quota(owner)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(found.total)
            pipe.hlen(found.sizes)
            total, files = await pipe.execute()
        return int(total or 0), int(files)


def _now_ms() -> int:
    return int(time.time() * 1000)
