"""The gateway's app factory."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from common.apikeys import KeyRing, parse_env_keys
from common.jobqueue import JobQueue
from common.redis_client import connect
from common.settings import GatewaySettings
from gateway import health, jobs, metrics, openai_api, openapi
from gateway.auth import ApiKeyAuth
from gateway.body_limit import BodySizeLimit
from gateway.errors import (
    ApiError,
    api_error_handler,
    http_error_handler,
    redis_error_handler,
    unexpected_error_handler,
)
from gateway.fleet import FleetView
from gateway.http_metrics import HttpMetrics
from gateway.state import AppState


def package_version() -> str:
    try:
        return version("ortfleet")
    except PackageNotFoundError:
        return "0.0.0"


def keyring(settings: GatewaySettings) -> KeyRing:
    env_keys = parse_env_keys(settings.api_keys.get_secret_value()) if settings.api_keys else []
    path = settings.api_keys_file.expanduser() if settings.api_keys_file else None
    return KeyRing(env_keys, path)


def build_app(settings: GatewaySettings | None = None) -> Starlette:
    """The gateway as an ASGI app; Redis is connected in the lifespan."""
    settings = settings or GatewaySettings()
    gateway_metrics = metrics.GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        redis = connect(settings.redis_url.get_secret_value())
        queue = JobQueue(redis, settings.job_ttl_s)
        app.state.ortfleet = AppState(settings, redis, queue, FleetView(redis), gateway_metrics)
        try:
            yield
        finally:
            await redis.aclose()

    app = Starlette(
        routes=[*jobs.routes, *openai_api.routes, *health.routes, *openapi.routes, *metrics.routes],
        middleware=[
            Middleware(HttpMetrics, metrics=gateway_metrics),
            Middleware(
                ApiKeyAuth,
                keyring=keyring(settings),
                metrics_key=settings.metrics_api_key.get_secret_value() if settings.metrics_api_key else None,
                default_requests_per_minute=settings.key_requests_per_minute,
                default_max_concurrent_jobs=settings.key_max_concurrent_jobs,
            ),
            Middleware(BodySizeLimit, max_bytes=settings.max_body_bytes),
        ],
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
