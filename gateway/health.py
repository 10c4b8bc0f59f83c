"""Liveness, readiness and the list of served models."""

from __future__ import annotations

from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import ApiError
from gateway.fleet import ModelState
from gateway.state import app_state


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    state = app_state(request)
    try:
        await state.redis.ping()
        fleet = await state.fleet.snapshot(fresh=True)
    except (RedisError, OSError) as e:
        return JSONResponse({"status": "unavailable", "reason": f"Redis is unreachable: {e}"}, 503)
    if not fleet.live:
        return JSONResponse({"status": "unavailable", "reason": "no live worker"}, 503)
    models = {name: {"workers": m.workers, "capacity": m.capacity} for name, m in fleet.live.items()}
    return JSONResponse({"status": "ready", "models": models})


def model_entry(m: ModelState) -> dict[str, Any]:
    return {
        "id": m.name,
        "object": "model",
        "created": 0,
        "owned_by": "ortfleet",
        "context_length": m.context_length,
        "workers": m.workers,
        "capacity": m.capacity,
        "in_flight": m.in_flight,
    }


async def list_models(request: Request) -> Response:
    fleet = await app_state(request).fleet.snapshot(fresh=True)
    data = [model_entry(m) for m in sorted(fleet.live.values(), key=lambda m: m.name)]
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(request: Request) -> Response:
    name = request.path_params["model_id"]
    fleet = await app_state(request).fleet.snapshot(fresh=True)
    if name not in fleet.live:
        message = f"model {name!r} is not served by a live worker"
        raise ApiError(404, message, param="model", code="model_not_found")
    return JSONResponse(model_entry(fleet.live[name]))


routes = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
]
