"""The gateway's app factory."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from common.aio import cancel_and_wait
from common.apikeys import KeyRing, parse_env_keys
from common.gateway_settings import GatewaySettings
from gateway import health, jobs, lora_adapters, metrics, metrics_route, openai_api, openapi, tokenizer
from gateway.auth import ApiKeyAuth
from gateway.batches import routes as batches
from gateway.batches.driver import BatchDriver
from gateway.body_limit import BodySizeLimit
from gateway.console import routes as console_routes
from gateway.errors import (
    ApiError,
    ClientGone,
    api_error_handler,
    client_gone_handler,
    http_error_handler,
    redis_error_handler,
    unexpected_error_handler,
)
from gateway.files import routes as files
from gateway.fleet import FleetView
from gateway.fleet_overview import routes as fleet_routes
from gateway.http_metrics import HttpMetrics
from gateway.openai_api.choices import JOB_ID_HEADER
from gateway.responses import routes as responses
from gateway.shards import open_shards
from gateway.state import AppState
from gateway.streaming.slots import StreamSlots
from gateway.streaming.tokens import StreamTokens

MULTIPART_OVERHEAD_BYTES = 65_536  # a file upload's form fields and part headers


def package_version() -> str:
    try:
        return version("ortfleet")
    except PackageNotFoundError:
        return "0.0.0"


def keyring(settings: GatewaySettings) -> KeyRing:
    env_keys = parse_env_keys(settings.api_keys.get_secret_value()) if settings.api_keys else []
    path = settings.api_keys_file.expanduser() if settings.api_keys_file else None
    return KeyRing(env_keys, path)


def cors(settings: GatewaySettings) -> list[Middleware]:
    """CORS for the origins in ORTFLEET_CORS_ORIGINS, outermost, so preflights never need a key."""
    origins = [origin.strip() for origin in settings.cors_origins.split(",") if origin.strip()]
    if not origins:
        return []
    exposed = [JOB_ID_HEADER, "Location", "Retry-After", "Idempotent-Replayed"]
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=exposed,
            max_age=600,
        )
    ]


def stream_tokens(settings: GatewaySettings) -> StreamTokens | None:
    secret = settings.stream_token_secret
    return StreamTokens(secret.get_secret_value().encode(), settings.stream_token_ttl_s) if secret else None


def build_app(
    settings: GatewaySettings | None = None, gateway_metrics: metrics.GatewayMetrics | None = None
) -> Starlette:
    """The gateway as an ASGI app; Redis is connected in the lifespan."""
    settings = settings or GatewaySettings()
    gateway_metrics = gateway_metrics or metrics.GatewayMetrics(per_key=settings.metrics_per_key)
    tokens = stream_tokens(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with open_shards(settings) as shards:
            fleet = FleetView(
                [(shard.redis, shard.keys) for shard in shards.all], spread=shards.spread_models()
            )
            streams = StreamSlots(
                settings.key_max_open_streams,
                lambda: gateway_metrics.rejected.labels("too_many_streams").inc(),
            )
            app.state.ortfleet = AppState(settings, shards, fleet, gateway_metrics, streams)
            driver = asyncio.create_task(BatchDriver(app.state.ortfleet).run(), name="batch-driver")
            try:
                yield
            finally:
                await cancel_and_wait(driver)

    app = Starlette(
        routes=[
            *jobs.routes,
            *openai_api.routes,
            *files.routes,
            *batches.routes,
            *responses.routes,
            *tokenizer.routes,
            *lora_adapters.routes,
            *health.routes,
            *openapi.routes,
            *metrics_route.routes,
            *fleet_routes,
            *console_routes,
        ],
        middleware=[
            *cors(settings),
            Middleware(HttpMetrics, metrics=gateway_metrics),
            Middleware(
                ApiKeyAuth,
                keyring=keyring(settings),
                metrics_key=settings.metrics_api_key.get_secret_value() if settings.metrics_api_key else None,
                default_requests_per_minute=settings.key_requests_per_minute,
                default_max_concurrent_jobs=settings.key_max_concurrent_jobs,
                default_max_prompt_tokens_in_flight=settings.key_max_prompt_tokens_in_flight,
                default_tokenize_chars_per_s=settings.key_tokenize_chars_per_s,
                stream_token_key=tokens.key_of if tokens is not None else None,
                admin_key=settings.admin_api_key.get_secret_value() if settings.admin_api_key else None,
            ),
            Middleware(
                BodySizeLimit,
                max_bytes=settings.max_body_bytes,
                path_limits={"/v1/files": settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES},
            ),
        ],
        exception_handlers={
            ApiError: api_error_handler,
            ClientGone: client_gone_handler,
            HTTPException: http_error_handler,
            RedisError: redis_error_handler,
            Exception: unexpected_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.version = package_version()
    app.state.stream_tokens = tokens
    app.state.openapi = openapi.build_spec(app.routes, app.state.version)
    return app
