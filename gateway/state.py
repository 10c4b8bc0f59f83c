from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from starlette.requests import Request

from common.settings import GatewaySettings
from gateway.fleet import FleetView
from gateway.metrics import GatewayMetrics
from gateway.shards import Shards
from gateway.stream_slots import StreamSlots


@dataclass
class AppState:
    settings: GatewaySettings
    shards: Shards  # a job's Redis: its model's shard
    fleet: FleetView
    metrics: GatewayMetrics
    streams: StreamSlots

    @property
    def redis(self) -> Redis:
        """The home shard's Redis: API keys, rate limits, files, batches, responses."""
        return self.shards.home.redis


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.ortfleet
    return state
