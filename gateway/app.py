"""The gateway's app factory."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from common.jobqueue import JobQueue
from common.redis_client import connect
from common.settings import GatewaySettings
from gateway import health, jobs, openapi
from gateway.body_limit import BodySizeLimit
from gateway.errors import (
    ApiError,
    api_error_handler,
    http_error_handler,
    redis_error_handler,
    unexpected_error_handler,
)
from gateway.fleet import FleetView
from gateway.state import AppState


def package_version() -> str:
    try:
        return version("ortfleet")
    except PackageNotFoundError:
        return "0.0.0"


def build_app(settings: GatewaySettings | None = None) -> Starlette:
    """The gateway as an ASGI app; Redis is connected in the lifespan."""
    settings = settings or GatewaySettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        redis = connect(settings.redis_url.get_secret_value())
        app.state.ortfleet = AppState(settings, redis, JobQueue(redis, settings.job_ttl_s), FleetView(redis))
        try:
            yield
        finally:
            await redis.aclose()

    app = Starlette(
        routes=[*jobs.routes, *health.routes, *openapi.routes],
        middleware=[Middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)],
        exception_handlers={
            ApiError: api_error_handler,
            HTTPException: http_error_handler,
            RedisError: redis_error_handler,
            Exception: unexpected_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.openapi = openapi.build_spec(package_version())
    return app
