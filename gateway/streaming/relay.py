"""The gateway's stream relay: every job stream its clients follow is read through a few Redis connections.

The scripts that add entries to job streams publish the streams' keys on a notices channel
(common/jobs/). Each relay holds one subscription to it and, on each notice, reads just the
streams named there that its clients follow: one non-blocking `XREAD` over all of them (up to
`max_keys` a command), whose entries it fans out in-process. A worker's step writes (nearly all
entries: the tokens) carry their entries in the notice, each stream's with the id of the entry before
them: a follower that has that entry takes them without a read, and one further back (it joined, or
fell behind) gets a read from its own cursor. A follower that joins gets a read of its stream at once.
A resubscription (Redis away and back, a failover) and a slow sweep read every followed stream again,
so a lost notice delays entries but never loses them. Redis' work is per changed stream, not per
followed one.

A follower read by a task (`Follower.next`) has a bounded buffer; one that fills it (a slow client)
stops receiving, and once it has drained its buffer it joins again from its last entry, so the read
starts over from Redis, the source of truth. A follower with a callback (`on_arrival`) is handed each
read's entries in the relay's own turn and says itself when to stop (`pause`) and read on (`rejoin`).
A slow client never holds up the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import orjson
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import keys
from common.redis_client import connection_pool
from common.store_epoch import epoch_of
from gateway.streaming.ids import EntryId, KeyedEntry, parse_id

logger = logging.getLogger(__name__)

_EVENTS_PREFIX = keys.events("")
SWEEP_KEYS_PER_READ = 100  # streams re-read by a sweep added to each read of notified streams


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


class _Tap:
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
        relay: StreamRelay,
        after: Mapping[str, str],
        buffer: int,
        on_arrival: Callable[[], None] | None = None,
    ) -> None:
        self._relay = relay
        self._buffer: list[KeyedEntry] = []  # a list: an empty deque alone takes 0.6 KB
        self._limit = buffer
        self._on_arrival = on_arrival
        self._sleep = WakeableSleep()  # `next` waiting for entries
        self._taps = {key: _Tap(self, key, cursor) for key, cursor in after.items()}
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


def _bulk(text: str) -> bytes:
    """One argument of a Redis command, as RESP encodes it."""
    data = text.encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class _Reader:
    """One Redis connection's reads of the streams assigned to it: of those it was told have new
    entries (or that a follower just joined), never blocking, at most `max_keys` a command.

    The `XREAD` command is built encoded, a stream's key and start id at a time, so a read over
    thousands of streams costs no more Python work than joining two lists of bytes.
    """

    def __init__(self, relay: StreamRelay, connection: AbstractConnection, count: int, max_keys: int) -> None:
        self._relay = relay
        self.connection = connection
        self._count = count
        self._max_keys = max_keys
        self._head = b"".join(_bulk(part) for part in ("XREAD", "COUNT", str(count)))
        self.taps: dict[str, set[_Tap]] = {}
        self._read_from: dict[str, str] = {}  # per stream: the lowest cursor of its taps, or past it
        self._due: dict[str, None] = {}  # streams to read, in the order they were told of
        self._swept: dict[str, None] = {}  # streams to read again (a sweep, a resubscription), less urgent
        self._changed = asyncio.Event()
        self.waiting_since: float | None = None  # when the read in flight was sent (event-loop time)

    def _command(self, streams: dict[str, str]) -> bytes:
        count = 4 + 2 * len(streams)
        head = b"*%d\r\n%b%b" % (count, self._head, _bulk("STREAMS"))
        return head + b"".join(map(_bulk, streams)) + b"".join(map(_bulk, streams.values()))

    def attach(self, tap: _Tap) -> None:
        self.taps.setdefault(tap.key, set()).add(tap)
        current = self._read_from.get(tap.key)
        if current is None or tap.cursor_id < parse_id(current):
            self._read_from[tap.key] = tap.cursor
        self.due(tap.key)  # what the stream holds already

    def detach(self, tap: _Tap) -> None:
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
                await self.connection.send_packed_command(self._command(streams), check_health=False)
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

    def end_streams(self, which: Callable[[str], bool], fields: dict[str, str]) -> None:
        """Hands each tap of the streams `which` selects `fields` as an entry past its cursor."""
        for key in [key for key in self.taps if which(key)]:
            for tap in list(self.taps.get(key, ())):
                ms, seq = tap.cursor_id
                tap.follower.push((key, f"{ms}-{seq + 1}", fields))
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
            self._read_from[key] = entries[-1][0]
        for tap in receiving:  # last: a follower's callback may pause or rejoin its taps
            tap.follower.arrived()


class StreamRelay:
    """Reads the job streams of every open follower through `connections` Redis connections, and
    holds one more: the subscription to the stream notices that say which streams to read."""

    def __init__(
        self,
        url: str,
        *,
        connections: int,
        buffer: int,
        client_name: str | None = None,
        count: int = 512,
        max_keys: int = 1000,
        sweep_s: float = 5.0,
        socket_timeout_s: float = 30.0,
    ) -> None:
        self._buffer = buffer
        self._sweep_s = sweep_s
        # The connections come from the pool (kept: Sentinel-managed connections refer to it weakly),
        # so with a Sentinel URL each reconnects to whichever server is the primary then. Their
        # commands carry no timeout of their own (a timer, and a task for each write, on every read):
        # the sweep drops a connection whose reply is overdue instead. The subscription hears a PING
        # reply every sweep, so it is overdue when it has heard nothing for much longer.
        self._timeout_s = max(socket_timeout_s, 4 * sweep_s)
        self._pool = pool = connection_pool(
            url,
            decode_responses=True,
            client_name=client_name,
            socket_keepalive=True,
            socket_connect_timeout=self._timeout_s,
            retry=None,
        )
        self._readers = [
            _Reader(self, pool.connection_class(**pool.connection_kwargs), count, max_keys)
            for _ in range(connections)
        ]
        self._subscription: AbstractConnection = pool.connection_class(**pool.connection_kwargs)
        self._heard_at = 0.0  # when the subscription last heard from Redis (event-loop time)
        self._tasks: list[asyncio.Task[None]] = []
        self._unreachable_since: float | None = None
        self.lost_epochs: set[str] = set()
        self.closed = False

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(reader.run(), name="stream-relay") for reader in self._readers]
        self._tasks.append(asyncio.create_task(self._listen(), name="stream-notices"))
        self._tasks.append(asyncio.create_task(self._sweep(), name="stream-sweep"))

    async def close(self) -> None:
        self.closed = True
        for reader in self._readers:
            reader.wake()
        for task in self._tasks:  # a read in flight ends now
            task.cancel()
        if self._tasks:  # none when it never started
            await asyncio.wait(self._tasks, timeout=5)
        for reader in self._readers:
            await reader.connection.disconnect()
        await self._subscription.disconnect()

    async def _listen(self) -> None:
        """Holds the subscription to the stream notices. Each (re)subscription reads every stream
        again, for the notices missed while it was down."""
        delay = 0.05
        while not self.closed:
            try:
                await self._subscription.send_command("SUBSCRIBE", keys.STREAM_NOTICES)
                for reader in self._readers:
                    reader.all_due()
                while not self.closed:
                    message = await self._subscription.read_response()
                    self._heard_at = asyncio.get_running_loop().time()
                    delay = 0.05
                    if isinstance(message, list) and message and message[0] == "message":
                        self._noticed(message[2])
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                await self._subscription.disconnect()
                self.unreachable(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except RedisError as e:
                logger.warning("the stream relay's subscription failed (%s); subscribing again", e)
                await self._subscription.disconnect()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _noticed(self, notice: str) -> None:
        """The streams a notice names are due for a read, unless it carries their new entries."""
        names, _, carried = notice.partition("\n")
        if carried:
            try:
                writes = [(str(key), str(after), entries) for key, after, entries in orjson.loads(carried)]
            except (TypeError, ValueError) as e:  # orjson's errors are ValueErrors
                logger.warning("a stream notice's entries could not be read (%s); reading its streams", e)
            else:
                for key, after, entries in writes:
                    self._reader(key).carried(key, after, entries)
                return
        for key in names.split():
            self._reader(key).due(key)

    async def _sweep(self) -> None:
        """Every `sweep_s`, reads every stream again (a writer that sends no notices is still relayed,
        late), pings the subscription, whose reply shows it is alive, and drops the connections whose
        reply is overdue (Redis stalled, or gone without a word): their reads fail and start over."""
        loop = asyncio.get_running_loop()
        self._heard_at = loop.time()
        while not self.closed:
            await asyncio.sleep(self._sweep_s)
            now = loop.time()
            for reader in self._readers:
                if reader.waiting_since is not None and now - reader.waiting_since > self._timeout_s:
                    await self._drop(reader.connection, "a stream read")
                reader.all_due()
            if self._subscription.is_connected:
                if now - self._heard_at > self._timeout_s:
                    await self._drop(self._subscription, "the stream notices subscription")
                    continue
                with contextlib.suppress(RedisError, OSError):
                    await self._subscription.send_command("PING")
            else:
                self._heard_at = now

    async def _drop(self, connection: AbstractConnection, what: str) -> None:
        logger.warning("Redis has not answered %s for over %.0f s; reconnecting", what, self._timeout_s)
        await connection.disconnect(nowait=True)

    @contextlib.asynccontextmanager
    async def follow(
        self, after: Mapping[str, str], on_arrival: Callable[[], None] | None = None
    ) -> AsyncIterator[Follower]:
        """Follows each stream key of `after` from its entry id ("0-0": from the start)."""
        follower = self.follower(after, on_arrival)
        try:
            yield follower
        finally:
            follower.close()

    def follower(self, after: Mapping[str, str], on_arrival: Callable[[], None] | None = None) -> Follower:
        """As `follow`, for a follower whose life is not one block: `close` it."""
        return Follower(self, after, self._buffer, on_arrival)

    def _reader(self, key: str) -> _Reader:
        return self._readers[zlib.crc32(key.encode()) % len(self._readers)]

    def attach(self, tap: _Tap) -> None:
        self._reader(tap.key).attach(tap)

    def detach(self, tap: _Tap) -> None:
        self._reader(tap.key).detach(tap)

    def end_lost(self, epoch: str, fields: dict[str, str]) -> None:
        """Redis lost its data of `epoch`: every followed stream of a job of that epoch gets `fields` as
        its last entry now (it will never get another), and the relay answers `lost` for them after."""
        self.lost_epochs.add(epoch)
        for reader in self._readers:
            reader.end_streams(lambda key: epoch_of(key.removeprefix(_EVENTS_PREFIX)) == epoch, fields)

    def lost(self, job_id: str) -> bool:
        """Whether the job was lost with its Redis's data (`end_lost`)."""
        return epoch_of(job_id) in self.lost_epochs

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
