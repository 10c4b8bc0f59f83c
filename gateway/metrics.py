"""The gateway's Prometheus metrics and its `/metrics` route.

HTTP traffic is counted by the HttpMetrics middleware; queue depth and live workers per model are read
from Redis when Prometheus scrapes, so every gateway replica reports the same, correct figures.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.fleet_stats import QueueStats, queue_stats
from gateway.fleet import FleetView
from gateway.state import app_state

logger = logging.getLogger(__name__)

NAMESPACE = "ortfleet"
HTTP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class GatewayMetrics:
    """The metrics of one gateway process, in a registry of its own."""

    def __init__(self) -> None:
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
        self.jobs_submitted = Counter(
            "jobs_submitted",
            "Jobs this gateway queued (idempotent replays not counted).",
            ["model"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.fleet = FleetFigures()
        registry.register(self.fleet)

    async def refresh(self, redis: Redis, fleet: FleetView) -> None:
        """Read the figures that live in Redis; on a Redis error they are left out of this scrape."""
        try:
            snapshot = await fleet.snapshot(fresh=True)
            models = sorted(snapshot.known)
            queues = await queue_stats(redis, models)
        except (RedisError, OSError) as e:
            logger.warning("metrics: Redis is unreachable, queue figures left out (%s)", e)
            self.fleet.models = {}
            return
        self.fleet.models = {
            name: ModelFigures(queues[name], snapshot.live[name].workers if name in snapshot.live else 0)
            for name in models
        }


@dataclass(frozen=True)
class ModelFigures:
    queue: QueueStats
    workers: int


class FleetFigures:
    """Queue depth, oldest wait and live workers per model, as last read from Redis."""

    def __init__(self) -> None:
        self.models: dict[str, ModelFigures] = {}

    def collect(self) -> Iterable[Metric]:
        waiting = GaugeMetricFamily(
            f"{NAMESPACE}_num_requests_waiting", "Jobs waiting in the model's queue.", labels=["model"]
        )
        oldest = GaugeMetricFamily(
            f"{NAMESPACE}_queue_oldest_wait_seconds",
            "How long the oldest job in the model's queue has waited.",
            labels=["model"],
        )
        workers = GaugeMetricFamily(
            f"{NAMESPACE}_workers_live", "Workers serving the model with a live heartbeat.", labels=["model"]
        )
        for name, figures in self.models.items():
            waiting.add_metric([name], figures.queue.depth)
            oldest.add_metric([name], figures.queue.oldest_wait_s)
            workers.add_metric([name], figures.workers)
        return [waiting, oldest, workers]


async def metrics_endpoint(request: Request) -> Response:
    state = app_state(request)
    await state.metrics.refresh(state.redis, state.fleet)
    body = generate_latest(state.metrics.registry)
    return Response(body, headers={"Content-Type": CONTENT_TYPE_LATEST})


routes = [Route("/metrics", metrics_endpoint, methods=["GET"])]
