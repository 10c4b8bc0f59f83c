"""Liveness and readiness, in ortfleet's words (/healthz, /readyz) and vLLM's and TGI's (/health), and
the version (/version)."""

from __future__ import annotations

import logging

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.operations import Operation, Reply
from gateway.state import app_state

logger = logging.getLogger(__name__)


@Operation("Liveness", responses={200: Reply("alive")})
async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


@Operation(
    "vLLM's and TGI's health check: 200, empty, while a worker serves",
    responses={200: Reply("serving"), 503: Reply("not serving")},
)
async def health(request: Request) -> Response:
    """vLLM's and TGI's check: 200 with an empty body while a worker serves; 503 otherwise."""
    reply = await readyz(request)
    if reply.status_code == 200:
        return Response(status_code=200)
    return reply


@Operation("ortfleet's version", responses={200: Reply("ok")})
async def version(request: Request) -> Response:
    return JSONResponse({"version": request.app.state.version})


@Operation(
    "Readiness: Redis reachable and a live worker",
    responses={200: Reply("ready"), 503: Reply("not ready")},
)
async def readyz(request: Request) -> Response:
    state = app_state(request)
    unreachable: list[str] = []  # stores other than the home one: the models of the others are served
    try:
        for name, shard in state.shards.named():
            try:
                await shard.redis.ping()
                await shard.watch.check_config()
                await shard.watch.check_memory()
            except (RedisError, OSError) as e:
                logger.warning("readiness: Redis (%s) is unreachable: %s", name, e)
                line = f"Redis is unreachable ({name}): {type(e).__name__}; the gateway's log has the address"
                if shard is state.shards.home:
                    return JSONResponse({"status": "unavailable", "reason": line}, 503)
                unreachable.append(line)
        fleet = await state.fleet.snapshot(fresh=True)
    except (RedisError, OSError) as e:
        reason = f"Redis is unreachable: {type(e).__name__}; the gateway's log has the address"
        return JSONResponse({"status": "unavailable", "reason": reason}, 503)
    # What an operator must hear of each Redis (no persistence, settings unreadable), ready or not, each
    # named `store N`: this answer is public, and the gateway's log has the addresses.
    said = unreachable + [line for name, shard in state.shards.named() for line in shard.watch.warnings(name)]
    warnings = {"warnings": said} if said else {}
    refused = [line for name, shard in state.shards.named() for line in shard.watch.refusals(name)]
    if refused:
        return JSONResponse({"status": "unavailable", "reason": "; ".join(refused), **warnings}, 503)
    if not fleet.live:
        return JSONResponse({"status": "unavailable", "reason": "no live worker", **warnings}, 503)
    # Public: ready workers per model, what a load balancer or a deployment waits for; no load figures.
    models = {name: {"workers": m.ready} for name, m in fleet.live.items() if m.ready}
    if not models:
        recovering = sum(m.workers for m in fleet.live.values())
        reason = f"no ready worker: {recovering} live worker(s) are rebuilding a failed engine"
        return JSONResponse({"status": "unavailable", "reason": reason, **warnings}, 503)
    return JSONResponse({"status": "ready", "models": models, **warnings})


routes = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
]
