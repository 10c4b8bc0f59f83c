from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def connect(url: str, *, max_connections: int | None = None) -> Redis:
    """A client that reconnects by itself, with backoff, when Redis goes away and comes back."""
    client: Redis = Redis.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=15,
        socket_keepalive=True,
    )
    return client
