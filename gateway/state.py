from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from redis.asyncio import Redis
from starlette.requests import Request

from common.gateway_settings import GatewaySettings
from common.keys import Keyspace
from gateway.fleet import FleetView
from gateway.metrics import GatewayMetrics
from gateway.placement import Placement
from gateway.shards import Shards
from gateway.stopping import Stopping
from gateway.streaming.slots import StreamSlots


@dataclass
class AppState:
    settings: GatewaySettings
    shards: Shards  # a job's Redis: a store of its model
    fleet: FleetView
    metrics: GatewayMetrics
    streams: StreamSlots
    # Set when a batch is created here: this gateway's batch driver, resting while no batch is active,
    # takes it up at once.
    batch_created: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the gateway is told to stop (SIGTERM): long-polls answer at once and OpenAI calls end with
    # server_shutting_down, before the server's graceful shutdown runs out and cuts them.
    stopping: Stopping = field(default_factory=Stopping)
    # Where this gateway placed jobs of models with several stores since its registry snapshot.
    placement: Placement = field(default_factory=Placement)

    @property
    def redis(self) -> Redis:
        """The home shard's Redis: API keys, rate limits, files, batches, responses."""
        return self.shards.home.redis

    @property
    def keys(self) -> Keyspace:
        """The home shard's keyspace: the names of what `redis` holds."""
        return self.shards.home.keys


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.ortfleet
    return state
