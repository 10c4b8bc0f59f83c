from __future__ import annotations

from typing import Any

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def gateway_client_name(pid: int) -> str:
    """The name a gateway process gives its Redis connections (CLIENT LIST shows it)."""
    return f"ortfleet-gateway-{pid}"


def connect(
    url: str,
    *,
    max_connections: int | None = None,
    socket_timeout_s: float | None = None,
    connect_timeout_s: float | None = None,
    client_name: str | None = None,
    retries: int = 8,
) -> Redis:
    """A client that reconnects by itself, with backoff, when Redis goes away and comes back.

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
    if max_connections is None:
        pool: ConnectionPool = ConnectionPool.from_url(url, **options)
    else:
        pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, **options)
    return Redis.from_pool(pool)
