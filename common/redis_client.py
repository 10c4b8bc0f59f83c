"""Redis clients and connection pools, made from any URL ortfleet supports (see common.redis_url).

A `redis+sentinel://` URL gives a pool whose connections ask the sentinels for the current primary
each time they connect: after a failover they reconnect to the new primary, and a write that reaches
a demoted primary (READONLY) drops its connection and is retried on the new one.
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis import Redis as SyncRedis
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import Sentinel as SyncSentinel

from common.redis_url import SentinelUrl, is_sentinel_url, parse_sentinel_url

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


_PACKED_IN_C: dict[type, type] = {}  # a connection class -> the same, packing in C


def connection_pool(url: str, *, max_connections: int | None = None, **options: Any) -> ConnectionPool:
    """A pool for `url` (redis://, rediss://, unix:// or redis+sentinel://) whose connections take
    `options` (redis-py connection arguments) and pack their commands in C. With `max_connections`, a
    command waits for a free connection rather than opening more. A malformed Sentinel URL raises
    BadRedisUrl."""
    pool = _pool(url, max_connections, options)
    base = pool.connection_class
    if base not in _PACKED_IN_C:
        _PACKED_IN_C[base] = type(base.__name__, (_PackedInC, base), {})
    pool.connection_class = _PACKED_IN_C[base]
    return pool


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
) -> Redis:
    """A client that reconnects by itself, with backoff, when Redis goes away and comes back (or, with
    a Sentinel URL, when another server becomes the primary).

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
    return Redis.from_pool(connection_pool(url, max_connections=max_connections, **options))


class HeldConnection:
    """One connection taken from a client's pool and kept, for commands mostly sent one after another
    (a worker's step writes, one per engine step): each costs a write and a read, without a client
    command's pool checkout, health check and retry wrapper. A command sent while another is out on the
    held connection goes through the client instead (a connection reads one reply at a time). A
    command that fails, or whose caller is cancelled, drops the connection: the next one takes another
    from the pool (with Sentinel, on the primary of the moment). As the client does, a command that
    finds its connection gone (Redis restarted, or closed it) is sent once more, on a new one."""

    def __init__(self, redis: Redis) -> None:
        self._pool = redis.connection_pool
        self._connection: AbstractConnection | None = None
        self._busy = False  # a command is out on the held connection

    async def run_script(self, script: AsyncScript, keys: list[str], args: list[str]) -> Any:
        """Runs a registered script, loading it first if the server lacks it (restarted, or flushed)."""
        if self._busy:
            return await script(keys=keys, args=args)
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        reused = self._connection is not None
        self._busy = True
        try:
            return await self._run_script(script, command)
        except (RedisConnectionError, RedisTimeoutError):
            if not reused:
                raise
            return await self._run_script(script, command)
        finally:
            self._busy = False

    async def _run_script(self, script: AsyncScript, command: tuple[Any, ...]) -> Any:
        connection = self._connection
        if connection is None:
            connection = self._connection = await self._pool.get_connection()
        try:
            try:
                return await self._send(connection, command)
            except NoScriptError:
                await self._send(connection, ("SCRIPT", "LOAD", script.script))
                return await self._send(connection, command)
        except BaseException:
            self._connection = None
            await connection.disconnect()
            await self._pool.release(connection)
            raise

    @staticmethod
    async def _send(connection: AbstractConnection, command: tuple[Any, ...]) -> Any:
        await connection.send_packed_command(connection.pack_command(*command), check_health=False)
        return await connection.read_response()


def connect_blocking(url: str, timeout_s: float = 5.0) -> SyncRedis:
    """A synchronous client for `url` (Sentinel URLs included), for tools that are not async: the local
    launcher's waits and `ortfleet up`'s check of a given Redis."""
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
