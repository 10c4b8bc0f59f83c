"""Batch progress for operators: read from Redis by every gateway's /metrics and by `ortfleet status`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from redis.asyncio import Redis

from common.keys import Keyspace


@dataclass(frozen=True)
class BatchProgress:
    id: str
    owner: str
    status: str
    total: int
    completed: int
    failed: int
    in_flight: int
    created_at: float

    @property
    def answered(self) -> int:
        return self.completed + self.failed


async def active_batches(redis: Redis, keys: Keyspace) -> list[BatchProgress]:
    """The batches a driver still works on, oldest first."""
    ids: list[str] = await redis.zrange(keys.batches_active, 0, -1)
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for batch_id in ids:
            pipe.hmget(
                keys.batch(batch_id), ["owner", "status", "total", "completed", "failed", "created_at"]
            )
            pipe.hlen(keys.batch_in_flight(batch_id))
        replies = await pipe.execute()
    found = []
    for i, batch_id in enumerate(ids):
        owner, status, total, completed, failed, created = replies[2 * i]
        if status is None:
            continue
        found.append(
            BatchProgress(
                batch_id,
                owner or "",
                status,
                int(total or 0),
                int(completed or 0),
                int(failed or 0),
                int(replies[2 * i + 1]),
                float(created or 0),
            )
        )
    return found


class BatchMetrics:
    """Lines this gateway's driver answered and batches it ended (counters), and the progress of every
    active batch as last read from Redis (gauges, the same on every gateway)."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        self.namespace = namespace
        self.lines = Counter(
            "batch_requests_answered",
            "Batch lines this gateway's driver answered, by outcome (completed: in the output file, "
            "failed: in the error file).",
            ["outcome"],
            namespace=namespace,
            registry=registry,
        )
        self.ended = Counter(
            "batches_ended",
            "Batches this gateway's driver ended, by final status.",
            ["status"],
            namespace=namespace,
            registry=registry,
        )
        self.active: list[BatchProgress] = []
        registry.register(self)

    async def refresh(self, redis: Redis, keys: Keyspace) -> None:
        self.active = await active_batches(redis, keys)

    def collect(self) -> Iterable[Metric]:
        by_status = GaugeMetricFamily(
            f"{self.namespace}_batches_active", "Batches not yet ended, by status.", labels=["status"]
        )
        requests = GaugeMetricFamily(
            f"{self.namespace}_batch_requests",
            "Requests of the active batches: total, completed, failed and in flight (queued or running).",
            labels=["state"],
        )
        counts: dict[str, int] = {}
        for batch in self.active:
            counts[batch.status] = counts.get(batch.status, 0) + 1
        for status, count in sorted(counts.items()):
            by_status.add_metric([status], count)
        for state in ("total", "completed", "failed", "in_flight"):
            requests.add_metric([state], sum(getattr(batch, state) for batch in self.active))
        return [by_status, requests]
