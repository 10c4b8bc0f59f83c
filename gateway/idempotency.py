"""Idempotency-Key: where a key's job is found, that a retry repeats its request, and, for a model
whose jobs spread over several Redis stores, a key's tries over them.

On one Redis, the submit script writes the key and its job in one step. Over several stores each key
has a home store (gateway/placement.py's `key_home`), the first in its order: it lists every other store
a try of the key is sent to, before it is sent, and it holds the token of the try in flight, so that the
tries of a key go one at a time. A retry looks for the job on every store; while a store does not
answer and the job may be there, the retry gets 503 rather than a second job, naming the store.

While its home store is down, a key that never had a job gets that 503 too: the home store alone knows
whether a try of the key went anywhere (it may hold the job itself), and a record of each try on another
store as well would make every try of a key need two stores up instead of one."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.apikeys import Principal
from common.error_codes import ErrorCode
from common.wire import JobRequest, PriorityClass
from gateway.errors import ApiError
from gateway.placement import DOWN_S, key_home
from gateway.shards import Shard, Shards
from gateway.state import AppState


def idempotency_digest(principal: Principal, idempotency_key: str) -> str:
    """What names the job submitted under `idempotency_key` on each store (Keyspace.idempotency);
    idempotency keys are per owner."""
    scoped = f"{principal.name}\n{idempotency_key}"
    return hashlib.sha256(scoped.encode()).hexdigest()


def request_digest(request: JobRequest, priority: PriorityClass) -> str:
    """What an idempotent retry must repeat: the request and its class, as canonical JSON, hashed."""
    canonical = json.dumps(
        {"request": request.model_dump(mode="json"), "priority": priority.value},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


async def check_same_request(state: AppState, job_id: str, digest: str | None, idempotency_key: str) -> None:
    """422 when an Idempotency-Key comes back with another request than the one it was first used for."""
    found = await state.shards.record(job_id)
    record = found[1] if found else None
    if record is None or record.request_digest is None or record.request_digest == digest:
        return
    raise ApiError(
        422,
        f"Idempotency-Key {idempotency_key!r} was first used for another request (job {job_id}); "
        "a retry must repeat the request exactly, and a new request needs a new key",
        param="Idempotency-Key",
        code=ErrorCode.idempotency_key_reused,
    )


@dataclass(frozen=True)
class KeyTries:
    """An Idempotency-Key of a model with several stores: its digest (idempotency_digest), and its home
    store."""

    idem: str
    home: Shard


def key_tries(stores: list[Shard], idem: str | None) -> KeyTries | None:
    """The key's tries over the model's stores; None without a key, or on one store (where the submit
    script alone keeps it to one job)."""
    return KeyTries(idem, key_home(stores, idem)) if idem is not None and len(stores) > 1 else None


async def idempotent_job(shards: Shards, stores: list[Shard], tries: KeyTries) -> str | None:
    """The job an idempotency entry names on any of the model's stores (a retry finds it wherever the
    first try went); None when there is none. While a store does not answer, the key's home store says
    whether a try went there: then the job may be there, and the answer is 503 naming the store, never a
    second job."""
    idem, home = tries.idem, tries.home
    values = await asyncio.gather(
        *(store.redis.get(store.keys.idempotency(idem)) for store in stores), return_exceptions=True
    )
    if all(isinstance(value, BaseException) for value in values):
        raise next(value for value in values if isinstance(value, BaseException))
    if (found := next((value for value in values if isinstance(value, str)), None)) is not None:
        return found
    silent = [store for store, value in zip(stores, values, strict=True) if isinstance(value, BaseException)]
    if not silent:
        return None
    # The home store silent: the first try went there, or it lists where it went; either way, unknown.
    if any(store is home for store in silent):
        raise _unknown(shards, [home])
    tried: set[str] = await home.redis.smembers(home.keys.idempotency_tries(idem))  # type: ignore[misc]
    if unknown := [store for store in silent if store.label in tried]:
        raise _unknown(shards, unknown)
    return None


async def note_try(tries: KeyTries, store: Shard, ttl_s: int) -> None:
    """Lists `store` on the key's home store before the job is sent there, for the job's TTL (reset when
    an entry is added, so that it outlives the newest try's job)."""
    tried = tries.home.keys.idempotency_tries(tries.idem)
    async with tries.home.redis.pipeline(transaction=True) as pipe:
        pipe.sadd(tried, store.label)
        pipe.expire(tried, ttl_s)
        await pipe.execute()


@contextlib.asynccontextmanager
async def one_try_at_a_time(state: AppState, tries: KeyTries | None, stores: int) -> AsyncIterator[None]:
    """Over a model's several stores, the tries of one Idempotency-Key go one at a time. Each holds a
    token on the key's home store while it looks for the key's job and places it; otherwise two tries in
    flight at once could both find no job, the home store refuse one and take the other, and two jobs
    exist. A try that finds the token held gets 409 `idempotency_key_in_use`. Should a gateway die
    holding it, the token expires after the longest a try can take: each store's Redis calls, then the
    wait for replicas."""
    if tries is None:
        yield
        return
    home, settings = tries.home, state.settings
    each_s = 2 * settings.redis_socket_timeout_s + settings.submit_replicas_timeout_ms / 1000
    longest_s = stores * each_s + 1
    trying, token = home.keys.idempotency_try(tries.idem), secrets.token_hex(8)
    try:
        taken = await home.redis.set(trying, token, nx=True, px=int(longest_s * 1000))
    except (RedisConnectionError, RedisTimeoutError) as e:  # whether a try went elsewhere is unknown
        state.placement.unreachable(home)
        raise _unknown(state.shards, [home]) from e
    if not taken:
        raise ApiError(
            409,
            "another request with this Idempotency-Key is being submitted: retry with the same key, which "
            "then returns its job",
            code=ErrorCode.idempotency_key_in_use,
            headers={"Retry-After": "1"},
        )
    try:
        yield
    finally:
        with contextlib.suppress(RedisError):  # else it expires
            if await home.redis.get(trying) == token:
                await home.redis.delete(trying)


_RETRY_S = math.ceil(DOWN_S)  # a store that did not answer is tried again after DOWN_S


def _unknown(shards: Shards, silent: list[Shard]) -> ApiError:
    """A caller learns which store is down, named as /readyz names it, never where it is."""
    names = " and ".join(name for name, shard in shards.named() if any(shard is store for store in silent))
    return ApiError(
        503,
        f"the model's Redis {names} does not answer, and an earlier try with this Idempotency-Key may have "
        f"queued the job there: retry with the same key in {_RETRY_S} s, or once {names} is back (a new job "
        "is not made while that is unknown)",
        code=ErrorCode.store_unavailable,
        headers={"Retry-After": str(_RETRY_S)},
    )
