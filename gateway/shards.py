"""Where a model's jobs live: the fleet's Redis, or Redis servers of the model's own
(ORTFLEET_REDIS_SHARDS): one, or several (the model's stores, each served by workers of its own).

A shard is one Redis as the gateway uses it: a pooled client, the job queue on it and the relay that
reads its job streams. A job lives on one store of its model from submission to expiry (its id carries
that Redis's epoch, so the store is known from the id); API keys, rate limits, files, batches and
responses live on the home shard (ORTFLEET_REDIS_URL), as do the jobs of every model the map leaves out.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from common.aio import cancel_and_wait
from common.gateway_settings import GatewaySettings
from common.jobs.queue import JobQueue
from common.jobs.record import JobRecord
from common.keys import Keyspace
from common.redis_client import (
    RedisRefused,
    RedisUnreachable,
    check_redis,
    connect_store,
    gateway_client_name,
)
from common.store_epoch import epoch_of
from common.store_watch import StoreWatch
from common.stores import Store
from common.wire import JobStatus
from gateway.queue_sweep import sweep_queue_deadlines
from gateway.streaming.reading import STORE_LOST
from gateway.streaming.relay import StreamRelay


@dataclass(frozen=True)
class Shard:
    label: str  # its URL, password masked (and its hash tag, on a Redis Cluster)
    redis: Redis
    keys: Keyspace  # the names of its keys on that Redis
    queue: JobQueue
    relay: StreamRelay
    watch: StoreWatch  # its memory policy and persistence


class Shards:
    """The gateway's shards: the home one, and the stores of each model given Redis servers of its own."""

    def __init__(self, home: Shard, by_model: dict[str, list[Shard]]) -> None:
        self.home = home
        self._by_model = by_model
        others = {id(s): s for stores in by_model.values() for s in stores if s is not home}
        self.all = [home, *others.values()]

    def named(self) -> list[tuple[str, Shard]]:
        """Each shard with the name answers give it (`store 1` is the home one): a caller learns how the
        stores fare, never where they are."""
        return [(f"store {i}", shard) for i, shard in enumerate(self.all, 1)]

    def of_model(self, model: str) -> Shard:
        """The model's first store (its only one, unless the shard map gives it several)."""
        return self.stores_of(model)[0]

    def stores_of(self, model: str) -> list[Shard]:
        """Every Redis that holds jobs of the model, in the order the shard map lists them."""
        return self._by_model.get(model) or [self.home]

    def full(self, model: str | None) -> str | None:
        """Why every store a job of `model` may go to (any store, for a job that names none) refuses writes
        for memory, if each does; each named as `named` names it. Read from the watches' last memory
        readings and refused writes: no round trip."""
        stores = self.stores_of(model) if model is not None else self.all
        names = {id(shard): name for name, shard in self.named()}
        said = [shard.watch.full_as(names[id(shard)]) for shard in stores]
        return "; ".join(line for line in said if line) if all(said) else None

    def spread_models(self) -> frozenset[str]:
        """The models with several stores."""
        return frozenset(model for model, stores in self._by_model.items() if len(stores) > 1)

    def holding(self, models: list[str]) -> list[tuple[Shard, list[str]]]:
        """Each shard with the models, of those given, whose jobs it holds (a model with several stores
        is in each of theirs)."""
        return [
            (shard, mine)
            for shard in self.all
            if (mine := [model for model in models if any(s is shard for s in self.stores_of(model))])
        ]

    def of_job(self, job_id: str, model: str) -> Shard:
        """The store of the model that holds the job: the one whose epoch its id carries (the model's
        first store for an id of a lost epoch, whose job is gone wherever it was)."""
        stores = self.stores_of(model)
        epoch = epoch_of(job_id)
        return next((store for store in stores if store.watch.epoch == epoch), stores[0])

    async def owned_record(self, job_id: str, owner: str) -> tuple[Shard, JobRecord] | None:
        """The shard holding the job and its record, if `owner` owns it (each shard is asked at once)."""
        return await self._find(lambda shard: shard.queue.owned_record(job_id, owner))

    async def record(self, job_id: str) -> tuple[Shard, JobRecord] | None:
        return await self._find(lambda shard: shard.queue.record(job_id))

    async def statuses(self, job_ids: list[str]) -> dict[str, JobStatus]:
        """The status of each of the jobs found on some shard (one pipeline a shard)."""
        found: dict[str, JobStatus] = {}
        for shard in self.all:
            async with shard.redis.pipeline(transaction=False) as pipe:
                for job_id in job_ids:
                    pipe.hget(shard.keys.job(job_id), "status")
                replies = await pipe.execute()
            found |= {job_id: JobStatus(raw) for job_id, raw in zip(job_ids, replies, strict=True) if raw}
        return found

    async def lost(self, job_id: str) -> bool:
        """Whether the job, not found, was lost with its Redis's data (the epoch its id carries was lost).
        Each Redis's epoch is read now: a loss in the last second is not yet known otherwise."""
        for shard in self.all:
            await shard.watch.check_epoch()
            if await shard.watch.is_lost(job_id):
                return True
        return False

    async def idempotent_job(self, digest: str) -> str | None:
        """The job an idempotency entry (named by its digest, gateway/idempotency.py) names, on the first
        shard holding one: it lives on the shard of the job it names."""
        values = await asyncio.gather(
            *(shard.redis.get(shard.keys.idempotency(digest)) for shard in self.all)
        )
        return next((value for value in values if value is not None), None)

    async def _find(
        self, lookup: Callable[[Shard], Awaitable[JobRecord | None]]
    ) -> tuple[Shard, JobRecord] | None:
        """The first shard where `lookup` finds the record; None when no shard has it. A shard that
        cannot be read matters only when no other has it (it might): its error is raised then."""
        found = await asyncio.gather(*(lookup(shard) for shard in self.all), return_exceptions=True)
        for shard, record in zip(self.all, found, strict=True):
            if isinstance(record, JobRecord):
                return shard, record
        for error in found:
            if isinstance(error, BaseException):
                raise error
        return None


@contextlib.asynccontextmanager
async def open_shards(settings: GatewaySettings) -> AsyncIterator[Shards]:
    """Connects to each distinct store of the settings (redis_url and the shard map: a Redis, or a hash
    tag on a Redis Cluster) and starts its relay; closes them all on exit. Each store gets the gateway's
    connection bounds of its own."""
    home = settings.home_store(await is_cluster(settings.redis_url.get_secret_value(), settings))
    model_stores = {model: settings.stores_for(model, home.cluster) for model in settings.redis_shards}
    shards: dict[Store, Shard] = {}
    watching: list[asyncio.Task[None]] = []
    try:
        for store in dict.fromkeys([home, *(store for stores in model_stores.values() for store in stores)]):
            shards[store] = shard = await _open(settings, store)
            watching.append(asyncio.create_task(shard.watch.run(), name="store-watch"))
            watching.append(
                asyncio.create_task(sweep_queue_deadlines(shard.queue, shard.label), name="sweep")
            )
        yield Shards(
            shards[home],
            {model: [shards[store] for store in stores] for model, stores in model_stores.items()},
        )
    finally:
        for task in watching:
            await cancel_and_wait(task)
        for shard in shards.values():
            await shard.relay.close()
            await shard.redis.aclose()


async def is_cluster(url: str, settings: GatewaySettings) -> bool:
    """Whether the Redis at `url` is a node of a Redis Cluster; when it does not answer, whether the shard
    map gives a model stores on a cluster (a gateway started while its Redis is away takes it for a
    standalone one otherwise, and is restarted once it is back)."""
    try:
        config = await asyncio.to_thread(check_redis, url, settings.redis_connect_timeout_s)
    except (RedisRefused, RedisUnreachable):
        return settings.cluster_stores
    return config.cluster


async def _open(settings: GatewaySettings, store: Store) -> Shard:
    name = gateway_client_name(os.getpid())
    redis = connect_store(
        store,
        max_connections=settings.redis_max_connections,
        client_name=name,
        socket_timeout_s=settings.redis_socket_timeout_s,
        connect_timeout_s=settings.redis_connect_timeout_s,
        retries=1,
    )
    relay = StreamRelay(
        store,
        connections=settings.relay_connections,
        buffer=settings.relay_buffer_events,
        client_name=name,
        outage_limit_s=settings.store_outage_limit_s,
    )
    await relay.start()
    label = store.label
    watch = StoreWatch(redis, store.keys, label, settings.allow_evicting_redis, settings.job_ttl_s)
    watch.on_loss.append(functools.partial(relay.end_lost, fields=STORE_LOST))
    return Shard(label, redis, store.keys, JobQueue(redis, settings.job_ttl_s, store.keys), relay, watch)
