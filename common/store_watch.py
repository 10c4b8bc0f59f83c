"""A process's watch over one Redis while it runs, for the logs, /readyz and the metrics: its memory
policy and persistence, read again periodically (common/store_config.py); its data epoch
(common/store_epoch.py), read every second, so that a Redis that lost its data is known to have lost it;
and its memory in use, read every second, so that a Redis that refuses writes for memory is named."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from common.keys import Keyspace
from common.store_config import StoreConfig, read_config
from common.store_epoch import current_epoch, epoch_of, note_lost, was_lost

logger = logging.getLogger(__name__)

CONFIG_EVERY_S = 30.0  # how often the memory policy and persistence are read again
EPOCH_EVERY_S = 1.0  # how often the epoch and the memory in use are read again
OUT_OF_MEMORY = "used memory > 'maxmemory'"  # in Redis's refusal of a write (OOM command not allowed ...)
OUT_OF_MEMORY_LOG_EVERY_S = 30.0


def headroom(maxmemory: int) -> int:
    """The memory short of `maxmemory` at which a Redis counts as full: 1/64 of it, between 1 and 64 MiB.
    Redis refuses a write when the memory in use, its clients' buffers included, is past maxmemory, so a
    Redis kept at its limit by a trickle of writes reads a little under it between two refusals; full
    from this much under, it stays full until twice this much is free again."""
    return min(max(maxmemory // 64, 2**20), 64 * 2**20)


@dataclass(frozen=True)
class StoreLoss:
    """A Redis found to have lost its data: its epoch `old` was gone, `new` in its place."""

    at: float  # time.time()
    old: str
    new: str


class StoreWatch:
    """What one process knows of one Redis's fitness to keep its work. `label` names the Redis in
    what it says (its URL, password masked)."""

    def __init__(
        self, redis: Redis, keys: Keyspace, label: str, allow_eviction: bool, ttl_s: int = 86_400
    ) -> None:
        self.redis = redis
        self.keys = keys  # the store's keyspace: its epoch and lost epochs
        self.label = label
        self.allow_eviction = allow_eviction
        self.ttl_s = ttl_s  # the job TTL: how long a loss matters (its jobs would have expired by then)
        self.config: StoreConfig | None = None  # None until read
        self.epoch: str | None = None  # None until read
        self.lost_epochs: set[str] = set()
        self.losses = 0
        self.last_loss: StoreLoss | None = None
        # Called with the lost epoch once a loss is found (the gateway ends its streams).
        self.on_loss: list[Callable[[str], None]] = []
        self._reading_epoch = asyncio.Lock()
        self.memory: tuple[int, int] | None = None  # used_memory, maxmemory (0: no limit), as last read
        # On a Redis Cluster, the id of the node that serves the store's slot, as last read (shown in
        # /v1/fleet and `ortfleet status` in place of its address, which a caller is never told)
        self.node: str | None = None
        self._filled = False  # full when last judged (headroom): past the high mark, or a write refused

    async def check_memory(self) -> None:
        """Reads the memory in use and its limit; says so in the log when Redis fills up, and when it has
        room again."""
        try:
            info = await self.redis.info("memory")
        except ResponseError:  # INFO disabled (some managed Redis): memory is not watched
            self.memory, self._filled = None, False
            return
        was_full = self.full is not None
        self.memory = used, limit = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
        if limit <= 0 or used < limit - 2 * headroom(limit):
            self._filled = False
        elif used >= limit - headroom(limit):
            self._filled = True
        full = self.full
        if full is not None and not was_full:
            logger.error("%s", full)
        elif full is None and was_full:
            logger.info("Redis at %s has memory again: writes are accepted", self.label)

    def note_refused(self) -> None:
        """A write was refused for memory: the Redis is full until a reading finds room (headroom)."""
        if not self._filled:
            logger.error("Redis at %s refused a write for memory: it is full", self.label)
        self._filled = True

    @property
    def full(self) -> str | None:
        """Why this Redis refuses writes for memory (used_memory at maxmemory, or about to be, and a
        policy that evicts nothing), if it does."""
        return self._full(self.label)

    def full_as(self, name: str) -> str | None:
        """`full`, naming this Redis `name` instead of its address."""
        return self._full(name)

    def _full(self, label: str) -> str | None:
        if not self._filled or (self.config is not None and self.config.evicts):
            return None
        if self.memory is None:  # a refused write, with INFO disabled: until the next reading
            return (
                f"Redis at {label} is out of memory (maxmemory reached): it refuses writes, so no job can "
                "be submitted or run; raise maxmemory or free memory"
            )
        used, limit = self.memory
        return (
            f"Redis at {label} is out of memory (used_memory {used / 2**20:.1f} MiB of maxmemory "
            f"{limit / 2**20:.1f} MiB): it refuses writes, so no job can be submitted or run; raise "
            "maxmemory or free memory"
        )

    async def check_epoch(self) -> str:
        """The Redis's epoch now; a change (or a Redis found without one) since the last read is a loss:
        logged, counted, recorded in the Redis and told to `on_loss`."""
        async with self._reading_epoch:
            current = await current_epoch(self.redis, self.keys, self.ttl_s)
            known, self.epoch = self.epoch, current
            if known is not None and current != known:
                await self._lost(known, current)
            return current

    async def _lost(self, old: str, new: str) -> None:
        self.lost_epochs.add(old)
        self.losses += 1
        self.last_loss = StoreLoss(time.time(), old, new)
        logger.error(
            "Redis at %s lost its data (restarted without persistence, or flushed): the jobs, streams, "
            "files and batches it held are gone; their clients get store_lost",
            self.label,
        )
        with contextlib.suppress(RedisError, OSError):  # this process knows it; others find it in time
            await note_lost(self.redis, self.keys, old, self.ttl_s)
        for callback in self.on_loss:
            callback(old)

    async def is_lost(self, job_id: str) -> bool:
        """Whether the job was lost with its Redis's data (its id carries an epoch that was lost)."""
        epoch = epoch_of(job_id)
        if epoch is None or epoch == self.epoch:
            return False
        return epoch in self.lost_epochs or await was_lost(self.redis, self.keys, epoch)

    async def check_config(self) -> StoreConfig:
        """Reads the memory policy and persistence again; says so in the log when they changed since
        the last read (the first read is the process's start, which said it already)."""
        config = await read_config(self.redis)
        if self.config is not None and config != self.config:
            if (refusal := self.refusal_of(config)) is not None:
                logger.error("%s", refusal)
            for line in config.warnings(self.label, self.allow_eviction):
                logger.warning("%s", line)
            if config.checked and not config.evicts and config.persists:
                logger.info("Redis at %s: maxmemory-policy %s, persistence on", self.label, config.policy)
        self.config = config
        return config

    def refusal_of(self, config: StoreConfig, label: str | None = None) -> str | None:
        if config.evicts and not self.allow_eviction:
            return config.eviction_refusal(label or self.label)
        return None

    @property
    def refusal(self) -> str | None:
        """Why this Redis is unfit to serve now (a policy that evicts keys, not allowed), if it is."""
        return self.refusal_of(self.config) if self.config is not None else None

    def refusals(self, name: str) -> list[str]:
        """Why this Redis cannot serve now (`refusal`, `full`), naming it `name` instead of its address:
        for answers to callers who should not learn where the store is."""
        refusal = self.refusal_of(self.config, name) if self.config is not None else None
        return [line for line in (refusal, self._full(name)) if line is not None]

    def problems(self, name: str) -> list[str]:
        """`refusals` and `warnings`, naming this Redis `name`."""
        return self.refusals(name) + self.warnings(name)

    def warnings(self, name: str | None = None) -> list[str]:
        """What an operator should know of this Redis short of a refusal: its settings, and a loss of
        its data within the job TTL; the Redis is named `name`, or by its address."""
        label = name or self.label
        said = self.config.warnings(label, self.allow_eviction) if self.config is not None else []
        loss = self.last_loss
        if loss is not None and time.time() - loss.at < self.ttl_s:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(loss.at))
            said.append(
                f"Redis at {label} lost its data (found at {when}): the jobs submitted before are gone "
                "and answer store_lost"
            )
        return said

    async def run(self) -> None:
        """Reads the epoch every EPOCH_EVERY_S and the settings every CONFIG_EVERY_S, until cancelled; a
        Redis away is skipped over."""
        loop = asyncio.get_running_loop()
        config_due = loop.time()
        while True:
            try:
                await self.check_epoch()
                await self.check_memory()
                if self.keys.tag is not None:
                    self.node = await store_node(self.redis)
                if loop.time() >= config_due:
                    await self.check_config()
                    config_due = loop.time() + CONFIG_EVERY_S
            except (RedisError, OSError) as e:
                logger.debug("Redis at %s could not be read (%s)", self.label, e)
            await asyncio.sleep(EPOCH_EVERY_S)


async def store_node(redis: Redis) -> str:
    """The id of the Redis Cluster node a store's connections reach (the primary of its slot)."""
    node_id: str = await redis.execute_command("CLUSTER MYID")  # type: ignore[no-untyped-call]
    return node_id


class StoreMetrics:
    """The watched Redises' fitness as Prometheus figures, read from the watches when scraped."""

    def __init__(self, watches: Callable[[], Iterable[StoreWatch]], namespace: str = "ortfleet") -> None:
        self._watches = watches
        self._namespace = namespace

    def collect(self) -> Iterable[Metric]:
        ns = self._namespace
        checked = GaugeMetricFamily(
            f"{ns}_redis_config_checked",
            "1 when the Redis's memory policy and persistence could be read (CONFIG GET), else 0.",
            labels=["redis"],
        )
        evicting = GaugeMetricFamily(
            f"{ns}_redis_evicting",
            "1 when the Redis's maxmemory-policy evicts keys (anything but noeviction), else 0.",
            labels=["redis"],
        )
        persistent = GaugeMetricFamily(
            f"{ns}_redis_persistent",
            "1 when the Redis keeps its data across a restart (appendonly or RDB snapshots), else 0.",
            labels=["redis"],
        )
        losses = CounterMetricFamily(
            f"{ns}_store_losses",
            "Times this process found the Redis had lost its data (its epoch gone: restarted without "
            "persistence, or flushed).",
            labels=["redis"],
        )
        full = GaugeMetricFamily(
            f"{ns}_redis_full",
            "1 while the Redis refuses writes for memory (used_memory at maxmemory, noeviction), else 0.",
            labels=["redis"],
        )
        for watch in self._watches():
            losses.add_metric([watch.label], watch.losses)
            if watch.memory is not None:
                full.add_metric([watch.label], 1 if watch.full is not None else 0)
            config = watch.config
            if config is None:
                continue
            checked.add_metric([watch.label], 1 if config.checked else 0)
            if config.checked:
                evicting.add_metric([watch.label], 1 if config.evicts else 0)
                persistent.add_metric([watch.label], 1 if config.persists else 0)
        return [checked, evicting, persistent, losses, full]


class OutOfMemoryLines(logging.Filter):
    """Lets through one log line a period about Redis refusing writes for memory (each retried claim,
    heartbeat and write would log one), noting how many it held back."""

    def __init__(self, period_s: float = OUT_OF_MEMORY_LOG_EVERY_S) -> None:
        super().__init__()
        self.period_s = period_s
        self._last = -period_s
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if OUT_OF_MEMORY not in text and not (record.exc_info and OUT_OF_MEMORY in str(record.exc_info[1])):
            return True
        now = time.monotonic()
        if now - self._last < self.period_s:
            self._held += 1
            return False
        if self._held:
            record.msg, record.args = f"{text} ({self._held} like it held back)", ()
        self._last, self._held = now, 0
        return True


def quiet_out_of_memory_lines() -> None:
    """Installs OutOfMemoryLines on the handlers of the root logger (call it after logging is set up)."""
    lines = OutOfMemoryLines()
    for handler in logging.getLogger().handlers:
        handler.addFilter(lines)
