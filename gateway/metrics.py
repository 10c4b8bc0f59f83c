"""The gateway's Prometheus metrics (served by `gateway.metrics_route`).

HTTP traffic is counted by the HttpMetrics middleware; queue depth and live workers per model are read
from Redis when Prometheus scrapes, so every gateway replica reports the same, correct figures.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from redis.exceptions import RedisError

from common.fleet_stats import QueueStats, queue_stats, served_tokens, summed
from common.store_watch import StoreMetrics, StoreWatch
from gateway.batch_progress import BatchMetrics
from gateway.fleet import FleetView
from gateway.shards import Shards

logger = logging.getLogger(__name__)

NAMESPACE = "ortfleet"
HTTP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class GatewayMetrics:
    """The metrics of one gateway process, in a registry of its own."""

    def __init__(self, per_key: bool = False) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.http_requests = Counter(
            "http_requests",
            "HTTP requests answered, by route template, method and status code.",
            ["route", "method", "status"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.http_duration = Histogram(
            "http_request_duration_seconds",
            "Time to answer an HTTP request (a stream: until it ends).",
            ["route", "method"],
            namespace=NAMESPACE,
            registry=registry,
            buckets=HTTP_BUCKETS,
        )
        self.sse_streams = Gauge(
            "sse_streams_active",
            "Server-sent event streams open now, by route.",
            ["route"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.sse_client_pauses = Counter(
            "sse_client_pauses",
            "Times a job's event stream stopped writing because its client read slower than the events "
            "came; it reads on from Redis once the client has caught up.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.jobs_submitted = Counter(
            "jobs_submitted",
            "Jobs this gateway queued (idempotent replays not counted).",
            ["model"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.rejected = Counter(
            "requests_rejected",
            "Requests refused by a protective limit, by reason (header_too_large, read_timeout, "
            "json_too_deep, number_too_long, invalid_json, invalid_text, too_many_streams, store_timeout).",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.gc_pauses = Histogram(
            "gc_pause_seconds",
            "Time the gateway's event loop stood still for a garbage collection, by generation "
            "(2: a full collection, which walks every object of every open stream).",
            ["generation"],
            namespace=NAMESPACE,
            registry=registry,
            buckets=GC_BUCKETS,
        )
        self.fleet = FleetFigures(per_key)
        registry.register(self.fleet)
        self.batches = BatchMetrics(registry, NAMESPACE)
        self.store_watches: list[StoreWatch] = []  # the shards' watches, as of the last scrape
        registry.register(StoreMetrics(lambda: self.store_watches, NAMESPACE))

    async def refresh(self, shards: Shards, fleet: FleetView) -> None:
        """Read the figures that live in Redis; on a Redis error they are left out of this scrape."""
        self.store_watches = [shard.watch for shard in shards.all]
        try:
            snapshot = await fleet.snapshot(fresh=True)
            models = sorted(snapshot.known)
            queues: list[dict[str, QueueStats]] = []
            served: list[dict[str, collections.Counter[str]]] = []
            for shard, mine in shards.holding(models):
                queues.append(await queue_stats(shard.redis, shard.keys, mine))
                served.append(
                    {
                        name: collections.Counter(await served_tokens(shard.redis, shard.keys, name))
                        for name in mine
                    }
                )
            await self.batches.refresh(shards.home.redis, shards.home.keys)
        except (RedisError, OSError) as e:
            logger.warning("metrics: Redis is unreachable, queue figures left out (%s)", e)
            self.fleet.models = {}
            return
        queue, tokens = summed(queues), summed(served)
        self.fleet.models = {
            name: ModelFigures(
                queue[name], snapshot.live[name].workers if name in snapshot.live else 0, dict(tokens[name])
            )
            for name in models
        }


@dataclass(frozen=True)
class ModelFigures:
    queue: QueueStats
    workers: int
    served: dict[str, int]  # tokens served per "<class>" and "<class>:<key>"


def _gauge(name: str, documentation: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}_{name}", documentation, labels=list(labels))


def _counter(name: str, documentation: str, *labels: str) -> CounterMetricFamily:
    return CounterMetricFamily(f"{NAMESPACE}_{name}", documentation, labels=list(labels))


class FleetFigures:
    """Queue depth, oldest wait, live workers and served tokens per model, as last read from Redis; by
    priority class, and by key only when the operator allows it (one series per key and class)."""

    def __init__(self, per_key: bool = False) -> None:
        self.models: dict[str, ModelFigures] = {}
        self.per_key = per_key

    def collect(self) -> Iterable[Metric]:
        waiting = _gauge("num_requests_waiting", "Jobs waiting in the model's queue.", "model")
        oldest = _gauge(
            "queue_oldest_wait_seconds", "How long the oldest job in the model's queue has waited.", "model"
        )
        workers = _gauge("workers_live", "Workers serving the model with a live heartbeat.", "model")
        by_class = _gauge(
            "queued_jobs", "Jobs waiting in the model's queue, by priority class.", "model", "priority"
        )
        served = _counter(
            "served_tokens",
            "Tokens served (prompt and generated) by the model's finished jobs, by priority class.",
            "model",
            "priority",
        )
        families: list[Metric] = [waiting, oldest, workers, by_class, served]
        if self.per_key:
            waiting_keys = _gauge(
                "queued_jobs_by_key",
                "Jobs near the head of the model's queue, by class and API key.",
                "model",
                "priority",
                "key",
            )
            served_keys = _counter(
                "served_tokens_by_key",
                "Tokens served by the model's finished jobs, by priority class and API key.",
                "model",
                "priority",
                "key",
            )
            families += [waiting_keys, served_keys]
        for name, figures in self.models.items():
            waiting.add_metric([name], figures.queue.depth)
            oldest.add_metric([name], figures.queue.oldest_wait_s)
            workers.add_metric([name], figures.workers)
            for cls, count in figures.queue.by_class.items():
                by_class.add_metric([name, cls], count)
            for label, tokens in figures.served.items():
                cls, sep, key = label.partition(":")
                if not sep:
                    served.add_metric([name, cls], tokens)
                elif self.per_key:
                    served_keys.add_metric([name, cls, key], tokens)
            if self.per_key:
                for label, count in figures.queue.waiting_keys.items():
                    cls, _, key = label.partition(":")
                    waiting_keys.add_metric([name, cls, key], count)
        return families
