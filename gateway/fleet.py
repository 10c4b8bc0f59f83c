"""What the gateway knows of the fleet: models ever served and the workers alive now."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.keys import Keyspace
from common.registry import live_workers, serving, worker_adapters
from common.wire import PRIORITY_ORDER

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelState:
    name: str
    context_length: int
    workers: int
    capacity: int
    in_flight: int
    ready: int = 0  # workers that can run jobs now: not those rebuilding a failed engine
    speed_tokens_per_s: float = 0.0  # what its ready workers measured while running jobs (WorkerInfo's)
    kv_budget_tokens: int = 0  # the most KV tokens a job may need on one of its live workers (their largest)
    queued: int = 0  # jobs waiting in its queues: read only per store, for a model with several stores
    adapters: dict[str, str] = field(default_factory=dict)  # its LoRA adapters: name -> folder on its workers


@dataclass(frozen=True)
class FleetSnapshot:
    known: dict[str, int]  # model -> context length, for every model a worker ever registered
    live: dict[str, ModelState]
    # (id of a Redis client, model) -> the model's workers registered there: a model with several stores
    by_store: dict[tuple[int, str], ModelState] = field(default_factory=dict)
    read_at: float = field(default_factory=time.monotonic)  # when its read began (the monotonic clock)
    # LoRA adapter name -> the known model whose workers serve it (a model's name wins over an adapter's)
    adapters: dict[str, str] = field(default_factory=dict)


class FleetView:
    """A snapshot of the registry, refreshed at most every `max_age_s` so submissions stay cheap. Callers
    that find it stale at once share one read of it."""

    def __init__(
        self,
        redises: list[tuple[Redis, Keyspace]],
        max_age_s: float = 0.5,
        spread: frozenset[str] = frozenset(),
    ) -> None:
        self._redises = redises  # every shard's, with its keyspace: a model's workers register on its shard
        self._spread = spread  # models with several stores: each store's queue depth is read too
        self._max_age_s = max_age_s
        self._snapshot: FleetSnapshot | None = None
        self._reading: asyncio.Task[FleetSnapshot] | None = None

    async def snapshot(self, *, fresh: bool = False) -> FleetSnapshot:
        """The registry as last read, read again when older than `max_age_s`; with `fresh`, as read by a
        read that began after this call."""
        asked_at = time.monotonic()
        while True:
            snapshot = self._snapshot
            if snapshot is not None and (snapshot.read_at >= asked_at if fresh else self._young(snapshot)):
                return snapshot
            if self._reading is None:
                self._reading = asyncio.create_task(self._read(), name="fleet-read")
                self._reading.add_done_callback(self._read_done)
            snapshot = await asyncio.shield(self._reading)
            if not fresh or snapshot.read_at >= asked_at:
                return snapshot

    def _young(self, snapshot: FleetSnapshot) -> bool:
        return time.monotonic() - snapshot.read_at <= self._max_age_s

    def _read_done(self, reading: asyncio.Task[FleetSnapshot]) -> None:
        self._reading = None
        if not reading.cancelled() and reading.exception() is None:
            self._snapshot = reading.result()

    async def _read(self) -> FleetSnapshot:
        read_at = time.monotonic()
        known: dict[str, int] = {}
        live: dict[str, ModelState] = {}
        by_store: dict[tuple[int, str], ModelState] = {}
        adapters: dict[str, str] = {}
        unreachable: list[RedisError] = []
        for redis, keys in self._redises:
            try:
                known_raw: dict[str, str] = await redis.hgetall(keys.models)  # type: ignore[misc]
                registered = await live_workers(redis, keys)
            except RedisError as e:  # its models' other stores, and other models, are served meanwhile
                unreachable.append(e)
                continue
            for name, raw in known_raw.items():
                model_info = json.loads(raw)
                known[name] = int(model_info.get("context_length", 0))
                adapters |= dict.fromkeys(model_info.get("adapters", ()), name)
            for worker in registered:
                name = worker["model"]
                live[name] = _with_worker(live.get(name), worker)
                by_store[id(redis), name] = _with_worker(by_store.get((id(redis), name)), worker)
                known.setdefault(name, live[name].context_length)
                adapters |= dict.fromkeys(live[name].adapters, name)
            spread_here = [name for name in self._spread if (id(redis), name) in by_store]
            try:
                depths = await _queue_depths(redis, keys, spread_here)
            except RedisError as e:
                unreachable.append(e)
                continue
            for name, depth in depths.items():
                by_store[id(redis), name] = replace(by_store[id(redis), name], queued=depth)
        if unreachable and len(unreachable) == len(self._redises):
            raise unreachable[0]
        if unreachable:
            logger.warning(
                "%d of %d Redis servers unreachable: %s", len(unreachable), len(self._redises), unreachable[0]
            )
        adapters = {adapter: model for adapter, model in adapters.items() if adapter not in known}
        return FleetSnapshot(known, live, by_store, read_at, adapters)


async def _queue_depths(redis: Redis, keys: Keyspace, models: list[str]) -> dict[str, int]:
    """The jobs waiting in each model's queues (every class) on this Redis."""
    if not models:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            for cls in PRIORITY_ORDER:
                pipe.zcard(keys.queue(model, cls.value))
        counts: list[int] = await pipe.execute()
    per = len(PRIORITY_ORDER)
    return {model: sum(counts[i * per : (i + 1) * per]) for i, model in enumerate(models)}


def _with_worker(before: ModelState | None, worker: dict[str, str]) -> ModelState:
    """A model's state with one more live worker counted."""
    if before is None:
        before = ModelState(worker["model"], int(worker["context_length"]), 0, 0, 0)
    return ModelState(
        before.name,
        before.context_length,
        before.workers + 1,
        before.capacity + int(worker["capacity"]),
        before.in_flight + int(worker.get("in_flight", "0")),
        before.ready + int(serving(worker)),
        before.speed_tokens_per_s + (_speed(worker) if serving(worker) else 0.0),
        max(before.kv_budget_tokens, _kv_budget(worker)),
        adapters=before.adapters | worker_adapters(worker),
    )


def _kv_budget(worker: dict[str, str]) -> int:
    """The KV tokens a job may need on the worker: its budget, or its context when it has none below it."""
    budget = int(worker.get("kv_budget_tokens", "0") or 0)
    return budget if budget > 0 else int(worker["context_length"])


def _speed(worker: dict[str, str]) -> float:
    try:
        return max(0.0, float(worker.get("speed_tokens_per_s", "0")))
    except ValueError:
        return 0.0
