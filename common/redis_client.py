"""Redis clients and connection pools, made from any URL ortfleet supports (see common.redis_url).

A `redis+sentinel://` URL gives a pool whose connections ask the sentinels for the current primary
each time they connect: after a failover they reconnect to the new primary, and a write that reaches
a demoted primary (READONLY) drops its connection and is retried on the new one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any, cast

import hiredis
from redis import Redis as SyncRedis
from redis._parsers import BaseParser
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AuthenticationError,
    DataError,
    InvalidResponse,
    NoScriptError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import Sentinel as SyncSentinel

from common.aio import wait_set
from common.redis_cluster import SlotConnection, SlotRoute, SlotSSLConnection, redirected, route_of
from common.redis_url import BadRedisUrl, SentinelUrl, is_sentinel_url, mask_url, parse_sentinel_url
from common.store_config import StoreConfig, read_config_blocking
from common.stores import Store

SENTINEL_TIMEOUT_S = 2.0  # a sentinel answers at once, or is down and the next one is asked


class BlockingSentinelConnectionPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel-managed pool that holds at most `max_connections`: a command waits for a free one."""


def gateway_client_name(pid: int) -> str:
    """The name a gateway process gives its Redis connections (CLIENT LIST shows it)."""
    return f"ortfleet-gateway-{pid}"


def _sentinel_options(parsed: SentinelUrl, timeout_s: float) -> dict[str, Any]:
    """How to talk to the sentinels themselves (not to the primary they name)."""
    return {
        "socket_timeout": timeout_s,
        "username": parsed.sentinel_username,
        "password": parsed.sentinel_password,
    }


class _PackedInC:
    """Packs each command with hiredis, in C, as redis-py's synchronous client does; its asyncio
    client packs them in Python, which costs more than anything else a worker does per engine step (a
    step write carries some 10 arguments per job). The bytes are the same."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str):  # a command name of several words ("CLIENT SETNAME") is split
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError as e:  # None, a bool or another type Redis has no form for
            raise DataError(f"a Redis command argument must be str, int, float or bytes: {e}") from e


class _NoPingInHandshake(AbstractConnection):
    """A connection that sends its handshake (AUTH, CLIENT SETNAME, SELECT...) without a health check.
    redis-py PINGs before a command once `health_check_interval` has passed since the last reply, and a
    connection just opened has had none: it PINGs before the handshake's first command. A server that
    wants a password the URL lacks answers NOAUTH, the failed PING reconnects, and the reconnection's
    handshake PINGs again: unbounded recursion (RecursionError) instead of AuthenticationError."""

    async def on_connect(self) -> None:
        self.next_health_check = asyncio.get_running_loop().time() + self.health_check_interval
        await super().on_connect()


# A connection class -> the same, packing in C and sending its handshake without a health check.
_TUNED: dict[type, type] = {}


def connection_pool(
    url: str, *, max_connections: int | None = None, tag: str | None = None, **options: Any
) -> ConnectionPool:
    """A pool for `url` (redis://, rediss://, unix:// or redis+sentinel://) whose connections take
    `options` (redis-py connection arguments) and pack their commands in C. With `max_connections`, a
    command waits for a free connection rather than opening more. With `tag`, `url` names a node of a
    Redis Cluster and every connection goes to the primary of that hash tag's slot (common/redis_cluster.py).
    A malformed Sentinel URL raises BadRedisUrl. TCP's options (keep-alive) are left out for a Unix
    socket, which has none."""
    if url.startswith("unix:"):
        options = {k: v for k, v in options.items() if not k.startswith("socket_keepalive")}
    pool = _pool(url, max_connections, options)
    if tag is not None:
        _route_to_slot(pool, tag)
    base = pool.connection_class
    if base not in _TUNED:
        _TUNED[base] = type(base.__name__, (_PackedInC, _NoPingInHandshake, base), {})
    pool.connection_class = _TUNED[base]
    return pool


def _route_to_slot(pool: ConnectionPool, tag: str) -> None:
    """Makes the pool's connections go to the primary of the tag's slot, the pool's own address a seed."""
    kwargs = pool.connection_kwargs
    if "host" not in kwargs:
        raise BadRedisUrl("a Redis Cluster is reached over TCP (redis:// or rediss://), not a Unix socket")
    ssl = issubclass(pool.connection_class, SSLConnection)
    seeds = [(str(kwargs["host"]), int(kwargs.get("port", 6379)))]
    kwargs["slot_route"] = SlotRoute(seeds, tag, {**kwargs, "ssl": ssl})
    pool.connection_class = SlotSSLConnection if ssl else SlotConnection


def _pool(url: str, max_connections: int | None, options: dict[str, Any]) -> ConnectionPool:
    if not is_sentinel_url(url):
        if max_connections is None:
            return ConnectionPool.from_url(url, **options)
        return BlockingConnectionPool.from_url(url, max_connections=max_connections, **options)
    parsed = parse_sentinel_url(url)
    connect_timeout = options.get("socket_connect_timeout") or SENTINEL_TIMEOUT_S
    sentinel_options = _sentinel_options(parsed, SENTINEL_TIMEOUT_S)
    sentinel_options.update(
        socket_connect_timeout=min(connect_timeout, SENTINEL_TIMEOUT_S),
        socket_keepalive=True,
        decode_responses=True,
    )
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_options)  # type: ignore[no-untyped-call]
    options = {**options, "db": parsed.db, "username": parsed.username, "password": parsed.password}
    if max_connections is None:
        return SentinelConnectionPool(parsed.service, sentinel, is_master=True, **options)  # type: ignore[no-untyped-call]
    return BlockingSentinelConnectionPool(  # type: ignore[no-untyped-call]
        parsed.service, sentinel, is_master=True, max_connections=max_connections, **options
    )


def connect(
    url: str,
    *,
    max_connections: int | None = None,
    socket_timeout_s: float | None = None,
    connect_timeout_s: float | None = None,
    client_name: str | None = None,
    retries: int = 8,
    tag: str | None = None,
) -> Redis:
    """A client that reconnects by itself, with backoff, when Redis goes away and comes back (or, with
    a Sentinel URL, when another server becomes the primary; with a hash `tag` on a Redis Cluster, when
    another primary serves its slot).

    With `max_connections`, the client never holds more: a command waits for a free connection.
    With `socket_timeout_s`, a command Redis does
    not answer in time raises TimeoutError instead of hanging (blocking reads must block for less).
    """
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=retries),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "health_check_interval": 15,
        "socket_keepalive": True,
        "client_name": client_name,
    }
    return Redis.from_pool(connection_pool(url, max_connections=max_connections, tag=tag, **options))


def connect_store(store: Store, **options: Any) -> Redis:
    """`connect` for a store: its Redis, or the primary of its hash tag's slot on a Redis Cluster."""
    return connect(store.url, tag=store.keys.tag, **options)


class HeldConnection:
    """One connection taken from a client's pool and kept, for commands mostly sent one after another
    (a worker's step writes, one per engine step): each costs a write and a read, without a client
    command's pool checkout, health check and retry wrapper. A command sent while another is out on the
    held connection goes through the client instead (a connection reads one reply at a time). A
    command that fails, or whose caller is cancelled, drops the connection: the next one takes another
    from the pool (with Sentinel, on the primary of the moment). As the client does, a command that
    finds its connection gone (Redis restarted, or closed it) is sent once more, on a new one.

    The held connection's replies are read from its socket directly, with the event loop not watching
    it (`DirectReplies`), so that a command's caller can leave its reply there until it wants it
    (`reply_after`): a worker reads a step write's reply when it sends the next one, and is not woken
    for it in between."""

    def __init__(self, redis: Redis) -> None:
        self._pool = redis.connection_pool
        self._connection: AbstractConnection | None = None
        self._replies: DirectReplies | None = None  # None over TLS: read through the client's parser
        self._busy = False  # a command is out on the held connection

    async def run_script(
        self, script: AsyncScript, keys: list[str], args: list[str], reply_after: asyncio.Event | None = None
    ) -> Any:
        """Runs a registered script, loading it first if the server lacks it (restarted, or flushed).
        With `reply_after`, its reply is read once that event is set, or after REPLY_WAIT_S at most."""
        if self._busy:
            return await script(keys=keys, args=args)
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        reused = self._connection is not None
        self._busy = True
        try:
            return await self._run_script(script, command, reply_after)
        except (RedisConnectionError, RedisTimeoutError):
            if not reused:
                raise
            return await self._run_script(script, command, reply_after)
        finally:
            self._busy = False

    async def _run_script(
        self, script: AsyncScript, command: tuple[Any, ...], reply_after: asyncio.Event | None
    ) -> Any:
        connection = self._connection
        if connection is None:
            connection = self._connection = await self._pool.get_connection()
            self._replies = DirectReplies.of(connection)
        try:
            try:
                return await self._send(connection, command, reply_after)
            except NoScriptError:
                await self._send(connection, ("SCRIPT", "LOAD", script.script))
                return await self._send(connection, command)
        except BaseException:
            self._connection = self._replies = None
            await connection.disconnect()
            await self._pool.release(connection)
            raise

    async def _send(
        self,
        connection: AbstractConnection,
        command: tuple[Any, ...],
        reply_after: asyncio.Event | None = None,
    ) -> Any:
        await connection.send_packed_command(connection.pack_command(*command), check_health=False)
        if self._replies is None:
            return await connection.read_response()
        if reply_after is not None:
            await wait_set(reply_after, REPLY_WAIT_S)
        return await self._replies.next()


REPLY_WAIT_S = 0.25  # the longest a reply left in a held connection's socket waits to be read


class DirectReplies:
    """A held connection's replies, read from its socket directly. Its transport stops reading (once
    the loop has seen the socket readable after that, it no longer watches it), so a reply can wait in
    the socket without waking the process. A reply not there yet when it is wanted is awaited through
    the transport, which stops reading again after it."""

    READ_SIZE = 65536

    def __init__(
        self, transport: asyncio.Transport, stream: asyncio.StreamReader, route: SlotRoute | None = None
    ) -> None:
        self._route = route  # the connection's hash slot on a Redis Cluster
        self._transport = transport
        self._stream = stream
        self._fd: int = transport.get_extra_info("socket").fileno()
        self._parser = hiredis.Reader(replyError=BaseParser.parse_error, encoding="utf-8", errors="replace")
        transport.pause_reading()

    @classmethod
    def of(cls, connection: AbstractConnection) -> DirectReplies | None:
        """Replies of a connection just taken from its pool (nothing unread on it); None over TLS, whose
        bytes on the socket are not the replies."""
        # redis-py keeps a connection's asyncio streams in private attributes.
        stream, writer = connection._reader, connection._writer
        if stream is None or writer is None:
            raise RedisConnectionError("the connection taken from the pool is not connected")
        transport = cast(asyncio.Transport, writer.transport)  # uvloop's are not registered as one
        if transport.get_extra_info("sslcontext") is not None or transport.get_extra_info("socket") is None:
            return None
        return cls(transport, stream, route_of(connection))

    async def next(self) -> Any:
        """The next reply; raises it if it is an error (as the client would: NoScriptError for NOSCRIPT),
        and ConnectionError when the connection is gone or its server is no longer the primary."""
        while (reply := self._parser.gets()) is False:
            data = self._waiting()
            if data is None:
                data = await self._arriving()
            if not data:
                raise RedisConnectionError("Redis closed the connection")
            self._parser.feed(data)
        if isinstance(reply, ResponseError) and self._route is not None:
            moved = redirected(reply, self._route)  # the slot served elsewhere: the next connection finds it
            if moved is not None:
                raise moved
        if isinstance(reply, ReadOnlyError):  # a demoted primary: the next connection finds the new one
            raise RedisConnectionError(f"the server is no longer the primary: {reply}")
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    def _waiting(self) -> bytes | None:
        """What the socket holds now (b'' at its end), or None when it holds nothing yet."""
        if self._transport.is_closing():  # its descriptor may be closed, or another file's by now
            return b""
        try:
            return os.read(self._fd, self.READ_SIZE)
        except BlockingIOError:
            return None
        except OSError as e:
            raise RedisConnectionError(f"reading from Redis failed: {e}") from e

    async def _arriving(self) -> bytes:
        self._transport.resume_reading()
        try:
            return await self._stream.read(self.READ_SIZE)
        finally:
            if not self._transport.is_closing():
                self._transport.pause_reading()


def connect_blocking(url: str, timeout_s: float = 5.0, *, cluster: bool = False) -> SyncRedis:
    """A synchronous client for `url` (Sentinel URLs included; with `cluster`, redis-py's cluster client
    seeded by that node), for tools that are not async: the local launcher's waits and `ortfleet up`'s
    check of a given Redis."""
    if cluster:
        return cast(
            SyncRedis,
            SyncRedisCluster.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
            ),
        )
    if not is_sentinel_url(url):
        return SyncRedis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
    parsed = parse_sentinel_url(url)
    sentinel = SyncSentinel(  # type: ignore[no-untyped-call]
        list(parsed.sentinels), sentinel_kwargs=_sentinel_options(parsed, timeout_s), socket_timeout=timeout_s
    )
    client: SyncRedis = sentinel.master_for(  # type: ignore[no-untyped-call]
        parsed.service,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        socket_connect_timeout=timeout_s,
        decode_responses=True,
    )
    return client


class RedisUnreachable(Exception):
    """No Redis answered at a URL (refused, timed out, a name that does not resolve, no primary known)."""


class RedisRefused(Exception):
    """A mistake in a Redis URL, not an outage: the server that answered will not serve it (a password it
    wants or rejects, a database it lacks, no Redis at all), or no client can be made from it."""


def check_redis(url: str, timeout_s: float, *, allow_cluster: bool = True) -> StoreConfig:
    """One PING of the Redis at `url` on a connection of its own, giving up after `timeout_s`, then its
    memory policy and persistence, and whether it is a node of a Redis Cluster (refused unless
    `allow_cluster`: a store listed by URL is a whole server). Raises RedisRefused or RedisUnreachable
    with a message that names the Redis (its password masked) and the problem."""
    shown = f"Redis at {mask_url(url)}"
    try:
        with connect_blocking(url, timeout_s) as client:
            client.ping()
            cluster = _cluster_node(client)
            if cluster and not allow_cluster:
                raise RedisRefused(
                    f"{shown} is a node of a Redis Cluster, and a store listed by its URL is a whole "
                    "standalone server: give the cluster as ORTFLEET_REDIS_URL and the model a number of "
                    'stores on it in ORTFLEET_REDIS_SHARDS ({"model": 3})'
                )
            if cluster and (state := _cluster_state(client)) != "ok":
                raise RedisRefused(
                    f"{shown} is a node of a Redis Cluster that does not serve every hash slot "
                    f"(cluster_state: {state}): give every slot a primary (redis-cli --cluster create, or "
                    "--cluster fix), then start again"
                )
            return dataclasses.replace(read_config_blocking(client), cluster=cluster)
    except AuthenticationError as e:
        if "authentication required" in str(e).lower():
            raise RedisRefused(f"{shown} wants a password and the URL gives none") from e
        if "without any password configured" in str(e):
            raise RedisRefused(f"{shown} has no password set, yet the URL gives one") from e
        raise RedisRefused(f"{shown} rejected the URL's password or user name ({e})") from e
    except (ResponseError, InvalidResponse) as e:
        raise RedisRefused(f"{shown} refused the connection: {e}") from e
    except (RedisError, OSError) as e:
        raise RedisUnreachable(f"{shown} is unreachable ({e})") from e
    except ValueError as e:  # a URL no client can be made from
        raise RedisRefused(f"{shown} cannot be used: {e}") from e


def cluster_node(url: str, timeout_s: float = 5.0) -> bool:
    """Whether the Redis at `url` is a node of a Redis Cluster (False when it does not answer)."""
    try:
        with connect_blocking(url, timeout_s) as client:
            return _cluster_node(client)
    except (RedisError, OSError, ValueError):
        return False


def _cluster_state(client: SyncRedis) -> str:
    """CLUSTER INFO's cluster_state: ok when every hash slot is served."""
    info = client.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]
    if not isinstance(info, dict):  # redis-py parses it into a dict; a raw reply is its lines
        info = dict(line.split(":", 1) for line in str(info).splitlines() if ":" in line)
    return str(info.get("cluster_state", "")).strip()


def _cluster_node(client: SyncRedis) -> bool:
    """Whether the server runs in cluster mode (False where INFO is disabled: nothing to tell)."""
    try:
        info: dict[str, Any] = client.info("cluster")  # type: ignore[assignment]
        return bool(info.get("cluster_enabled"))
    except ResponseError:
        return False
