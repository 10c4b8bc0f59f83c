from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from starlette.requests import Request

from common.jobqueue import JobQueue
from common.settings import GatewaySettings
from gateway.fleet import FleetView


@dataclass
class AppState:
    settings: GatewaySettings
    redis: Redis
    queue: JobQueue
    fleet: FleetView


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.ortfleet
    return state
