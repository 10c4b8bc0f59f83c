from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from starlette.requests import Request

from common.jobqueue import JobQueue
from common.settings import GatewaySettings
from gateway.fleet import FleetView
from gateway.metrics import GatewayMetrics
from gateway.relay import StreamRelay
from gateway.stream_slots import StreamSlots


@dataclass
class AppState:
    settings: GatewaySettings
    redis: Redis
    queue: JobQueue
    fleet: FleetView
    metrics: GatewayMetrics
    streams: StreamSlots
    relay: StreamRelay


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.ortfleet
    return state
