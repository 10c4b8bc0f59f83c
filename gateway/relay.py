"""The gateway's stream relay: every job stream its clients follow is read through a few Redis connections.

Each reader connection runs one blocking `XREAD` over all the streams assigned to it and fans the
entries out in-process to its followers. A follower that joins (or falls behind and comes back)
re-arms the read at once: the blocked `XREAD` is ended with `CLIENT UNBLOCK` from another connection.
Each follower has a bounded buffer; one that fills it (a slow client) stops receiving, and once it
has drained its buffer it joins again from its last entry, so the read starts over from Redis, the
source of truth. A slow client never holds up the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.redis_client import connection_pool

logger = logging.getLogger(__name__)

Entry = tuple[str, str, dict[str, str]]  # stream key, entry id, fields
EntryId = tuple[int, int]
POLL_MS = 50  # how long a read blocks where Redis refuses CLIENT UNBLOCK


def parse_id(entry_id: str) -> EntryId:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class _Tap:
    """One followed stream of one follower: the id of the last entry handed to the follower."""

    def __init__(self, follower: Follower, key: str, after: str) -> None:
        self.follower = follower
        self.key = key
        self.cursor = after
        self.cursor_id = parse_id(after)
        self.overflowed = False

    def offer(self, entry_id: str, parsed: EntryId, fields: dict[str, str]) -> bool:
        """Hands an entry to the follower; False when its buffer is full (it will come back for it)."""
        if parsed <= self.cursor_id:
            return True
        if not self.follower.push((self.key, entry_id, fields)):
            self.overflowed = True
            return False
        self.cursor, self.cursor_id = entry_id, parsed
        return True


class Follower:
    """Entries of one or more job streams, each after its own cursor, in order per stream."""

    def __init__(self, relay: StreamRelay, after: Mapping[str, str], buffer: int) -> None:
        self._relay = relay
        self._buffer: deque[Entry] = deque()
        self._limit = buffer
        self._ready = asyncio.Event()
        self._taps = {key: _Tap(self, key, cursor) for key, cursor in after.items()}
        for tap in self._taps.values():
            relay.attach(tap)

    def push(self, entry: Entry) -> bool:
        if len(self._buffer) >= self._limit:
            self._ready.set()
            return False
        self._buffer.append(entry)
        self._ready.set()
        return True

    async def next(self, timeout_s: float) -> list[Entry]:
        """What arrived since the last call; an empty list after `timeout_s` with nothing new."""
        if not self._buffer:
            self._rejoin()
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout_s)
        entries = list(self._buffer)
        self._buffer.clear()
        return entries

    def _rejoin(self) -> None:
        """Taps that fell behind read on from their last entry, now that the buffer has room."""
        for tap in self._taps.values():
            if tap.overflowed:
                tap.overflowed = False
                self._relay.attach(tap)

    def stop(self, key: str) -> None:
        tap = self._taps.pop(key, None)
        if tap is not None:
            self._relay.detach(tap)

    def close(self) -> None:
        for key in list(self._taps):
            self.stop(key)


def _bulk(text: str) -> bytes:
    """One argument of a Redis command, as RESP encodes it."""
    data = text.encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class _Reader:
    """One Redis connection's blocking read over the streams assigned to it.

    The `XREAD` command is kept encoded, a stream's key and start id at a time, so a read over
    thousands of streams costs no more Python work than joining two lists of bytes.
    """

    def __init__(self, relay: StreamRelay, connection: AbstractConnection, count: int, block_ms: int) -> None:
        self._relay = relay
        self.connection = connection
        self._count = count
        self._head = b""
        self.block(block_ms)
        self.taps: dict[str, set[_Tap]] = {}
        self._read_from: dict[str, str] = {}  # per stream: the lowest cursor of its taps, or past it
        self._key_args: dict[str, bytes] = {}  # the same streams in the same order, encoded
        self._id_args: dict[str, bytes] = {}
        self._changed = asyncio.Event()
        self._client_id: int | None = None
        self._reading = False  # a read is out (it may be blocked in Redis)
        self._unblocking: asyncio.Task[None] | None = None

    def block(self, block_ms: int) -> None:
        """How long a read waits for new entries."""
        parts = ("XREAD", "COUNT", str(self._count), "BLOCK", str(block_ms))
        self._head = b"".join(_bulk(part) for part in parts)

    def _start_at(self, key: str, entry_id: str) -> None:
        if key not in self._read_from:
            self._key_args[key] = _bulk(key)
        self._read_from[key] = entry_id
        self._id_args[key] = _bulk(entry_id)

    def _command(self) -> bytes:
        count = 6 + 2 * len(self._read_from)
        head = b"*%d\r\n%b%b" % (count, self._head, _bulk("STREAMS"))
        return head + b"".join(self._key_args.values()) + b"".join(self._id_args.values())

    def attach(self, tap: _Tap) -> None:
        self.taps.setdefault(tap.key, set()).add(tap)
        current = self._read_from.get(tap.key)
        if current is None or tap.cursor_id < parse_id(current):
            self._start_at(tap.key, tap.cursor)
            self._rearm()

    def detach(self, tap: _Tap) -> None:
        taps = self.taps.get(tap.key)
        if taps is None:
            return
        taps.discard(tap)
        if not taps:
            del self.taps[tap.key], self._read_from[tap.key], self._key_args[tap.key], self._id_args[tap.key]

    def _rearm(self) -> None:
        self._changed.set()
        if self._reading and self._unblocking is None:
            self._unblocking = asyncio.create_task(self._unblock())

    async def _unblock(self) -> None:
        """Ends the blocked read while a change waits for the next one (the read may not be blocked
        in Redis yet: then again a moment later)."""
        try:
            while self._changed.is_set() and self._reading and self._client_id is not None:
                if not await self._relay.waker.client_unblock(self._client_id):
                    await asyncio.sleep(0.001)
        except ResponseError as e:  # CLIENT UNBLOCK refused (an ACL): poll instead
            logger.warning("Redis refuses CLIENT UNBLOCK (%s): the relay reads every %d ms", e, POLL_MS)
            self.block(POLL_MS)
        except RedisError as e:
            logger.debug("could not wake the relay's read (%s); it ends on its own", e)
        finally:
            self._unblocking = None

    async def _read(self, command: bytes) -> Any:
        if self._client_id is None:
            await self.connection.send_command("CLIENT", "ID")
            self._client_id = int(await self.connection.read_response())
        self._reading = True
        await self.connection.send_packed_command(command, check_health=False)
        return await self.connection.read_response()

    def wake(self) -> None:
        self._changed.set()

    async def run(self) -> None:
        delay = 0.05
        while not self._relay.closed:
            if not self._read_from:
                self._changed.clear()
                await self._changed.wait()
                continue
            self._changed.clear()
            streams = dict(self._read_from)
            try:
                reply = await self._read(self._command())
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                self._client_id = None
                await self.connection.disconnect()
                self._relay.unreachable(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            except RedisError as e:  # not the connection's fault: read again, never give up the streams
                logger.warning("the stream relay's read failed (%s); reading again", e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            finally:
                self._reading = False
            delay = 0.05
            self._relay.reachable()
            for key, entries in reply or []:
                self._deliver(key, [(entry_id, _pairs(flat)) for entry_id, flat in entries], streams[key])

    def _deliver(self, key: str, entries: list[tuple[str, dict[str, str]]], sent_from: str) -> None:
        taps = self.taps.get(key)
        if taps is None:
            return
        # A tap further back than this read started (it joined while the read was out) gets nothing
        # from it: the next read starts from its cursor, so it sees its entries in order, without a gap.
        start = parse_id(sent_from)
        receiving = [tap for tap in taps if tap.cursor_id >= start]
        behind: list[_Tap] = []
        for entry_id, fields in entries:
            parsed = parse_id(entry_id)
            for tap in receiving:
                if not tap.overflowed and not tap.offer(entry_id, parsed, fields):
                    behind.append(tap)
        for tap in behind:
            self.detach(tap)
        # A tap that joined behind this read while it was out moved the start back: keep that.
        if key in self._read_from and self._read_from[key] == sent_from:
            self._start_at(key, entries[-1][0])


class StreamRelay:
    """Reads the job streams of every open follower through `connections` Redis connections.

    `waker` (the gateway's pooled client) sends the `CLIENT UNBLOCK` that re-arms a blocked read.
    """

    def __init__(
        self,
        url: str,
        waker: Redis,
        *,
        connections: int,
        buffer: int,
        client_name: str | None = None,
        count: int = 512,
        block_s: float = 30.0,
    ) -> None:
        self.waker = waker
        self._buffer = buffer
        # A read returns within block_s (empty): one that takes much longer is on a dead connection.
        # The readers' connections come from the pool (kept: Sentinel-managed connections refer to it
        # weakly), so with a Sentinel URL each reconnects to whichever server is the primary then.
        self._pool = pool = connection_pool(
            url,
            decode_responses=True,
            client_name=client_name,
            socket_keepalive=True,
            socket_timeout=block_s + 10,
            retry=None,
        )
        self._readers = [
            _Reader(self, pool.connection_class(**pool.connection_kwargs), count, int(block_s * 1000))
            for _ in range(connections)
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self._unreachable_since: float | None = None
        self.closed = False

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(reader.run(), name="stream-relay") for reader in self._readers]

    async def close(self) -> None:
        self.closed = True
        for reader in self._readers:
            reader.wake()
        for task in self._tasks:  # a read in flight ends now
            task.cancel()
        await asyncio.wait(self._tasks, timeout=5)
        for reader in self._readers:
            await reader.connection.disconnect()

    @contextlib.asynccontextmanager
    async def follow(self, after: Mapping[str, str]) -> AsyncIterator[Follower]:
        """Follows each stream key of `after` from its entry id ("0-0": from the start)."""
        follower = Follower(self, after, self._buffer)
        try:
            yield follower
        finally:
            follower.close()

    def _reader(self, key: str) -> _Reader:
        return self._readers[zlib.crc32(key.encode()) % len(self._readers)]

    def attach(self, tap: _Tap) -> None:
        self._reader(tap.key).attach(tap)

    def detach(self, tap: _Tap) -> None:
        self._reader(tap.key).detach(tap)

    def followed_streams(self) -> int:
        return sum(len(reader.taps) for reader in self._readers)

    def unreachable_for(self) -> float | None:
        """Seconds since the relay's reads started failing (Redis away); None while they work."""
        if self._unreachable_since is None:
            return None
        return time.monotonic() - self._unreachable_since

    def unreachable(self, error: Exception) -> None:
        if self._unreachable_since is None:
            logger.info("the stream relay cannot reach Redis (%s); streams wait", error)
            self._unreachable_since = time.monotonic()

    def reachable(self) -> None:
        if self._unreachable_since is not None:
            logger.info("the stream relay reaches Redis again")
            self._unreachable_since = None
