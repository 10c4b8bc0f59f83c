"""One Redis connection's reads of the job streams assigned to it, and its hand-over of their entries to
the taps that follow them."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.streaming.follower import Tap
from gateway.streaming.ids import parse_id

logger = logging.getLogger(__name__)

SWEEP_KEYS_PER_READ = 100  # streams re-read by a sweep added to each read of notified streams


class ReadOwner(Protocol):
    """What a reader reports to (the relay): whether to go on reading, and whether Redis answers."""

    closed: bool

    def unreachable(self, error: Exception) -> None: ...

    def reachable(self) -> None: ...


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class StreamReader:
    """One Redis connection's reads of the streams assigned to it: of those it was told have new
    entries (or that a follower just joined), never blocking, at most `max_keys` a command."""

    def __init__(self, relay: ReadOwner, connection: AbstractConnection, count: int, max_keys: int) -> None:
        self._relay = relay
        self.connection = connection
        self._count = count
        self._max_keys = max_keys
        self.taps: dict[str, set[Tap]] = {}
        self._read_from: dict[str, str] = {}  # per stream: the lowest cursor of its taps, or past it
        self._due: dict[str, None] = {}  # streams to read, in the order they were told of
        self._swept: dict[str, None] = {}  # streams to read again (a sweep, a resubscription), less urgent
        self._changed = asyncio.Event()
        self.waiting_since: float | None = None  # when the read in flight was sent (event-loop time)

    def attach(self, tap: Tap) -> None:
        self.taps.setdefault(tap.key, set()).add(tap)
        current = self._read_from.get(tap.key)
        if current is None or tap.cursor_id < parse_id(current):
            self._read_from[tap.key] = tap.cursor
        self.due(tap.key)  # what the stream holds already

    def detach(self, tap: Tap) -> None:
        taps = self.taps.get(tap.key)
        if taps is None:
            return
        taps.discard(tap)
        if not taps:
            del self.taps[tap.key], self._read_from[tap.key]
            self._due.pop(tap.key, None)
            self._swept.pop(tap.key, None)

    def due(self, key: str) -> None:
        """The stream has new entries (or may have): read it."""
        if key in self._read_from:
            self._due[key] = None
            self._changed.set()

    def carried(self, key: str, after: str, entries: list[Any]) -> None:
        """Entries a notice brought (`[id, [field, value, ...]]`), the stream's next after `after`: each
        tap that has every entry up to `after` takes them without a read; one further back reads them
        from its own cursor, in order."""
        if key in self.taps and entries:
            self._deliver(key, [(entry_id, _pairs(flat)) for entry_id, flat in entries], after)

    def all_due(self) -> None:
        """Read every stream again (notices may have been missed): a few at a time beside the streams
        notices name, so that re-reading thousands of streams does not hold up the ones with news."""
        self._swept.update(dict.fromkeys(self._read_from))
        self._changed.set()

    def _next_keys(self) -> list[str]:
        """The streams of the next read: every due one (up to `max_keys`), then swept ones: up to
        `SWEEP_KEYS_PER_READ` beside due ones, or a full read's worth when none is due."""
        keys = list(itertools.islice(self._due, self._max_keys))
        for key in keys:
            del self._due[key]
            self._swept.pop(key, None)  # read now: that is what the sweep asked for
        room = min(SWEEP_KEYS_PER_READ, self._max_keys - len(keys)) if keys else self._max_keys
        swept = list(itertools.islice(self._swept, room))
        for key in swept:
            del self._swept[key]
        return keys + swept

    def wake(self) -> None:
        self._changed.set()

    async def run(self) -> None:
        delay = 0.05
        while not self._relay.closed:
            if not self._due and not self._swept:
                self._changed.clear()
                await self._changed.wait()
                continue
            keys = self._next_keys()
            streams = {key: self._read_from[key] for key in keys}
            self.waiting_since = asyncio.get_running_loop().time()
            try:
                await self.connection.send_command(
                    "XREAD", "COUNT", self._count, "STREAMS", *streams, *streams.values(), check_health=False
                )
                reply = await self.connection.read_response()
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                await self.connection.disconnect()
                self._relay.unreachable(e)
                self._retry(keys)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            except RedisError as e:  # not the connection's fault: read again, never give up the streams
                logger.warning("the stream relay's read failed (%s); reading again", e)
                self._retry(keys)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            finally:
                self.waiting_since = None
            delay = 0.05
            self._relay.reachable()
            for key, entries in reply or []:
                self._deliver(key, [(entry_id, _pairs(flat)) for entry_id, flat in entries], streams[key])
                if len(entries) >= self._count:
                    self.due(key)  # more than one read's worth: read on

    def end_streams(
        self, which: Callable[[str], bool], fields: dict[str, str], *, at_cursor: bool = False
    ) -> None:
        """Hands each tap of the streams `which` selects `fields` as an entry past its cursor, or (with
        `at_cursor`: the stream goes on, and a client that resumes from this entry's id must miss
        nothing) with its cursor's id."""
        for key in [key for key in self.taps if which(key)]:
            for tap in list(self.taps.get(key, ())):
                self.end_tap(tap, fields, at_cursor=at_cursor)

    def end_tap(self, tap: Tap, fields: dict[str, str], *, at_cursor: bool = True) -> None:
        """As `end_streams`, for one tap (if it is still attached)."""
        if tap not in self.taps.get(tap.key, ()):
            return
        ms, seq = tap.cursor_id
        tap.follower.push((tap.key, tap.cursor if at_cursor else f"{ms}-{seq + 1}", fields))
        tap.follower.arrived()

    def _retry(self, keys: list[str]) -> None:
        for key in keys:
            self.due(key)

    def _deliver(self, key: str, entries: list[tuple[str, dict[str, str]]], sent_from: str) -> None:
        taps = self.taps.get(key)
        if taps is None:
            return
        # A tap further back than these entries start (it joined while the read was out, or missed a
        # notice) gets nothing from them: the next read starts from its cursor, so it sees its entries
        # in order, without a gap.
        start = parse_id(sent_from)
        receiving = [tap for tap in taps if tap.cursor_id >= start]
        if len(receiving) < len(taps):
            self.due(key)
        behind: list[Tap] = []
        for entry_id, fields in entries:
            parsed = parse_id(entry_id)
            for tap in receiving:
                if not tap.overflowed and not tap.offer(entry_id, parsed, fields):
                    behind.append(tap)
        for tap in behind:
            self.detach(tap)
        # A tap that joined behind this read while it was out moved the start back: keep that.
        if key in self._read_from and self._read_from[key] == sent_from:
            self._read_from[key] = entries[-1][0]
        for tap in receiving:  # last: a follower's callback may pause or rejoin its taps
            tap.follower.arrived()
