"""A follower of job streams: the entries the relay hands it, each stream after its own cursor, read by a
task (`Follower.next`) or handed to a callback (`on_arrival`). Each followed stream is a `Tap`, which the
relay reads for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Protocol

from gateway.streaming.ids import EntryId, KeyedEntry, parse_id


class Taps(Protocol):
    """What reads a follower's streams (the relay): `attach` starts handing a tap its stream's entries,
    `detach` stops."""

    def attach(self, tap: Tap) -> None: ...

    def detach(self, tap: Tap) -> None: ...


class WakeableSleep:
    """A sleep that something else may end early (`wake`): one future and one timer, for waits a relay
    ends thousands of times a second."""

    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    async def __call__(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(seconds, _end, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def wake(self) -> None:
        if self._waiter is not None:
            _end(self._waiter)


def _end(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Tap:
    """One followed stream of one follower: the id of the last entry handed to the follower."""

    __slots__ = ("cursor", "cursor_id", "follower", "key", "overflowed")  # one per open stream

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
    """Entries of one or more job streams, each after its own cursor, in order per stream.

    Read them with `next` (a task waits), or give `on_arrival`: the relay calls it once a read has
    handed this follower new entries, and the callback takes them with `take`, in the relay's own turn
    of the event loop (no task wakes per entry)."""

    __slots__ = ("_buffer", "_limit", "_on_arrival", "_relay", "_sleep", "_taps")  # one per open stream

    def __init__(
        self,
        relay: Taps,
        after: Mapping[str, str],
        buffer: int,
        on_arrival: Callable[[], None] | None = None,
    ) -> None:
        self._relay = relay
        self._buffer: list[KeyedEntry] = []  # a list: an empty deque alone takes 0.6 KB
        self._limit = buffer
        self._on_arrival = on_arrival
        self._sleep = WakeableSleep()  # `next` waiting for entries
        self._taps = {key: Tap(self, key, cursor) for key, cursor in after.items()}
        for tap in self._taps.values():
            relay.attach(tap)

    def push(self, entry: KeyedEntry) -> bool:
        """Buffers an entry; False when the buffer is full (its tap stops until `rejoin`). With
        `on_arrival` the buffer is emptied after each read, so it holds one read's entries at most."""
        if self._on_arrival is None and len(self._buffer) >= self._limit:
            return False
        self._buffer.append(entry)
        return True

    def arrived(self) -> None:
        """The relay has handed over what one read brought for this follower."""
        if not self._buffer:
            return
        if self._on_arrival is not None:
            self._on_arrival()
        else:
            self._sleep.wake()

    def push_to(self, on_arrival: Callable[[], None]) -> None:
        """From now on, hand each read to `on_arrival` (see the class), not to `next`: what is buffered
        already goes first, now."""
        self._on_arrival = on_arrival
        self.rejoin()
        if self._buffer:
            on_arrival()

    def take(self) -> list[KeyedEntry]:
        """The entries buffered so far, in order per stream; the buffer is empty after."""
        entries, self._buffer = self._buffer, []
        return entries

    @property
    def behind(self) -> bool:
        """Whether any stream stopped feeding this follower (its buffer filled, or `pause`)."""
        return any(tap.overflowed for tap in self._taps.values())

    def pause(self) -> None:
        """No more entries until `rejoin` (a slow client): each stream then reads on from its last entry."""
        for tap in self._taps.values():
            if not tap.overflowed:
                tap.overflowed = True
                self._relay.detach(tap)

    async def next(self, timeout_s: float) -> list[KeyedEntry]:
        """What arrived since the last call; an empty list after `timeout_s` with nothing new."""
        if not self._buffer:
            self.rejoin()
            await self._sleep(timeout_s)
        return self.take()

    def rejoin(self) -> None:
        """Streams that stopped feeding this follower read on from their last entry."""
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
