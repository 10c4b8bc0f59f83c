"""A process's watch over one Redis while it runs: its memory policy and persistence, read again
periodically (common/store_config.py), for the logs, /readyz and the metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.store_config import StoreConfig, read_config

logger = logging.getLogger(__name__)

CONFIG_EVERY_S = 30.0  # how often the memory policy and persistence are read again


class StoreWatch:
    """What one process knows of one Redis's fitness to keep its work. `label` names the Redis in
    what it says (its URL, password masked)."""

    def __init__(self, redis: Redis, label: str, allow_eviction: bool) -> None:
        self.redis = redis
        self.label = label
        self.allow_eviction = allow_eviction
        self.config: StoreConfig | None = None  # None until read

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

    def refusal_of(self, config: StoreConfig) -> str | None:
        if config.evicts and not self.allow_eviction:
            return config.eviction_refusal(self.label)
        return None

    @property
    def refusal(self) -> str | None:
        """Why this Redis is unfit to serve now (a policy that evicts keys, not allowed), if it is."""
        return self.refusal_of(self.config) if self.config is not None else None

    def warnings(self) -> list[str]:
        """What an operator should know of this Redis short of a refusal."""
        if self.config is None:
            return []
        return self.config.warnings(self.label, self.allow_eviction)

    async def run(self) -> None:
        """Reads the settings every CONFIG_EVERY_S, until cancelled; a Redis away is skipped over."""
        while True:
            try:
                await self.check_config()
            except (RedisError, OSError) as e:
                logger.debug("Redis at %s: its settings could not be read (%s)", self.label, e)
            await asyncio.sleep(CONFIG_EVERY_S)


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
        for watch in self._watches():
            config = watch.config
            if config is None:
                continue
            checked.add_metric([watch.label], 1 if config.checked else 0)
            if config.checked:
                evicting.add_metric([watch.label], 1 if config.evicts else 0)
                persistent.add_metric([watch.label], 1 if config.persists else 0)
        return [checked, evicting, persistent]
