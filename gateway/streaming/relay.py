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

While Redis is away the followers get nothing, and wait: once it answers again each stream reads on from
the last entry it had, so nothing is lost. Redis away for `outage_limit_s` ends every followed stream
(and one followed later, while it stays away) with an error entry of code `store_unavailable`
(`outage_end`): no reader waits on a store without end.

A follower read by a task (`Follower.next`) has a bounded buffer; one that fills it (a slow client)
stops receiving, and once it has drained its buffer it joins again from its last entry, so the read
starts over from Redis, the source of truth. A follower with a callback (`on_arrival`) is handed each
read's entries in the relay's own turn and says itself when to stop (`pause`) and read on (`rejoin`).
A slow client never holds up the others.

Each connection's reads are a `StreamReader` (stream_reader.py); followers and the `Tap` of each stream
they follow are in follower.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable, Mapping

import orjson
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.error_codes import ErrorCode
from common.redis_client import connection_pool
from common.store_epoch import epoch_of
from common.stores import Store
from common.wire import EventType
from gateway.streaming.follower import Follower, Tap
from gateway.streaming.stream_reader import StreamReader

logger = logging.getLogger(__name__)


class StreamRelay:
    """Reads the job streams of every open follower through `connections` Redis connections, and
    holds one more: the subscription to the stream notices that say which streams to read."""

    def __init__(
        self,
        store: Store,
        *,
        connections: int,
        buffer: int,
        client_name: str | None = None,
        count: int = 512,
        max_keys: int = 1000,
        sweep_s: float = 5.0,
        socket_timeout_s: float = 30.0,
        outage_limit_s: float = 60.0,
    ) -> None:
        self._buffer = buffer
        self.outage_limit_s = outage_limit_s
        self._sweep_s = sweep_s
        # The connections come from the pool (kept: Sentinel-managed connections refer to it weakly),
        # so with a Sentinel URL each reconnects to whichever server is the primary then. Their
        # commands carry no timeout of their own (a timer, and a task for each write, on every read):
        # the sweep drops a connection whose reply is overdue instead. The subscription hears a PING
        # reply every sweep, so it is overdue when it has heard nothing for much longer.
        self._timeout_s = max(socket_timeout_s, 4 * sweep_s)
        self.keys = store.keys  # the store's keyspace: its streams' and notices' names
        # On a Redis Cluster the notices are sharded (common/jobs/scripts/notice.lua): heard on the node
        # that serves the store's slot, where the subscription's connection goes.
        self._subscribe = "SSUBSCRIBE" if store.cluster else "SUBSCRIBE"
        self._pool = pool = connection_pool(
            store.url,
            tag=store.keys.tag,
            decode_responses=True,
            client_name=client_name,
            socket_keepalive=True,
            socket_connect_timeout=self._timeout_s,
            retry=None,
        )
        self._readers = [
            StreamReader(self, pool.connection_class(**pool.connection_kwargs), count, max_keys)
            for _ in range(connections)
        ]
        self._subscription: AbstractConnection = pool.connection_class(**pool.connection_kwargs)
        self._heard_at = 0.0  # when the subscription last heard from Redis (event-loop time)
        self._tasks: list[asyncio.Task[None]] = []
        self._unreachable_since: float | None = None
        self._outage_timer: asyncio.TimerHandle | None = None  # ends the streams at the outage limit
        self.lost_epochs: set[str] = set()
        self.closed = False

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(reader.run(), name="stream-relay") for reader in self._readers]
        self._tasks.append(asyncio.create_task(self._listen(), name="stream-notices"))
        self._tasks.append(asyncio.create_task(self._sweep(), name="stream-sweep"))

    async def close(self) -> None:
        self.closed = True
        if self._outage_timer is not None:
            self._outage_timer.cancel()
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
                await self._subscription.send_command(self._subscribe, self.keys.stream_notices)
                for reader in self._readers:
                    reader.all_due()
                while not self.closed:
                    message = await self._subscription.read_response()
                    self._heard_at = asyncio.get_running_loop().time()
                    self.reachable()  # Redis answered (also when no stream is followed, so none is read)
                    delay = 0.05
                    if isinstance(message, list) and message and message[0] in ("message", "smessage"):
                        self._noticed(message[2])
                    elif isinstance(message, list) and message and message[0] == "sunsubscribe":
                        # the store's slot moved to another primary: subscribe there
                        raise RedisConnectionError("the notices channel's hash slot moved to another node")
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

    def _reader(self, key: str) -> StreamReader:
        return self._readers[zlib.crc32(key.encode()) % len(self._readers)]

    def attach(self, tap: Tap) -> None:
        reader = self._reader(tap.key)
        reader.attach(tap)
        if self.outage_over():  # joined (or read on) while Redis stays away past the limit: it ends now
            asyncio.get_running_loop().call_soon(reader.end_tap, tap, self.outage_end())

    def detach(self, tap: Tap) -> None:
        self._reader(tap.key).detach(tap)

    def end_lost(self, epoch: str, fields: dict[str, str]) -> None:
        """Redis lost its data of `epoch`: every followed stream of a job of that epoch gets `fields` as
        its last entry now (it will never get another), and the relay answers `lost` for them after."""
        self.lost_epochs.add(epoch)
        events = self.keys.events_prefix
        for reader in self._readers:
            reader.end_streams(lambda key: epoch_of(key.removeprefix(events)) == epoch, fields)

    def lost(self, job_id: str) -> bool:
        """Whether the job was lost with its Redis's data (`end_lost`)."""
        return epoch_of(job_id) in self.lost_epochs

    def unreachable_for(self) -> float | None:
        """Seconds since the relay's reads started failing (Redis away); None while they work."""
        if self._unreachable_since is None:
            return None
        return time.monotonic() - self._unreachable_since

    def outage_over(self) -> bool:
        """Whether Redis has been away for `outage_limit_s` or longer: its readers give up on it."""
        away = self.unreachable_for()
        return away is not None and away >= self.outage_limit_s

    def outage_end(self) -> dict[str, str]:
        """The entry that ends a followed stream once Redis has been away for the outage limit."""
        return outage_end(self.outage_limit_s)

    def unreachable(self, error: Exception) -> None:
        """Redis did not answer (a read, the subscription, or a reader's own command): the outage starts
        now, unless it started earlier; `outage_limit_s` later, unless Redis answers meanwhile, every
        followed stream ends (`outage_end`)."""
        if self._unreachable_since is None:
            logger.info("the stream relay cannot reach Redis (%s); streams wait", error)
            self._unreachable_since = time.monotonic()
            if not self.closed:
                loop = asyncio.get_running_loop()
                self._outage_timer = loop.call_later(self.outage_limit_s, self._end_streams_for_outage)

    def reachable(self) -> None:
        if self._unreachable_since is not None:
            logger.info("the stream relay reaches Redis again")
            self._unreachable_since = None
            if self._outage_timer is not None:
                self._outage_timer.cancel()
                self._outage_timer = None

    def _end_streams_for_outage(self) -> None:
        self._outage_timer = None
        if self.closed or self._unreachable_since is None:  # (a timer may fire a hair early)
            return
        logger.warning(
            "Redis has been away for %.0f s (ORTFLEET_STORE_OUTAGE_LIMIT_S): its open streams end with "
            "store_unavailable",
            self.outage_limit_s,
        )
        fields = self.outage_end()
        for reader in self._readers:
            reader.end_streams(lambda _key: True, fields, at_cursor=True)


def outage_end(limit_s: float) -> dict[str, str]:
    """An error entry (not the job's: it may still run) that ends a stream whose Redis stayed away for
    `limit_s`; a reader sends it as the stream's last event."""
    return {
        "type": EventType.error.value,
        "message": f"the job store (Redis) has not answered for {limit_s:g} s; the job may still run: read "
        "it again once the store is back",
        "code": ErrorCode.store_unavailable.value,
    }
