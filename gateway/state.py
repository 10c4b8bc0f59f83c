from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from starlette.requests import Request

from common.jobqueue import JobQueue
from common.settings import GatewaySettings
from gateway.fleet import FleetView

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics


@dataclass
class AppState:
    settings: GatewaySettings
    redis: Redis
    queue: JobQueue
    fleet: FleetView
    metrics: GatewayMetrics


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.ortfleet
    return state
