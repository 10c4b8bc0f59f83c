"""`GET /v1/models` and `GET /v1/models/{id}`: the models served by live workers, in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.error_codes import ErrorCode
from gateway.auth import principal_of
from gateway.errors import ApiError, Error
from gateway.fleet import ModelState
from gateway.openai_api.tools import TOOL_PROMPT
from gateway.operations import Operation, Reply
from gateway.state import app_state


def model_entry(m: ModelState, tenant: bool = False) -> dict[str, Any]:
    """A model as a caller sees it; a tenant (a caller with a key) is not shown the fleet's load."""
    entry = {
        "id": m.name,
        "object": "model",
        "created": 0,
        "owned_by": "ortfleet",
        "root": m.name,  # vLLM: the model the served name stands for
        "parent": None,
        "max_model_len": m.context_length,  # vLLM's name
        "context_length": m.context_length,
        "workers": m.workers,
        "capacity": m.capacity,
        "in_flight": m.in_flight,
        "tool_prompt": TOOL_PROMPT,  # how tools reach the model (docs/api.md, Tool calling)
    }
    if tenant:
        del entry["in_flight"]
    return entry


@Operation("Models served by live workers", responses={200: Reply("models")})
async def list_models(request: Request) -> Response:
    fleet = await app_state(request).fleet.snapshot(fresh=True)
    tenant = principal_of(request.scope).name != ""
    data = [model_entry(m, tenant) for m in sorted(fleet.live.values(), key=lambda m: m.name)]
    return JSONResponse({"object": "list", "data": data})


@Operation(
    "One model served by live workers (OpenAI's shape)",
    responses={200: Reply("the model"), 404: Reply("not served", Error)},
)
async def retrieve_model(request: Request) -> Response:
    name = request.path_params["model_id"]
    fleet = await app_state(request).fleet.snapshot(fresh=True)
    if name not in fleet.live:
        message = f"model {name!r} is not served by a live worker"
        raise ApiError(404, message, param="model", code=ErrorCode.model_not_found)
    return JSONResponse(model_entry(fleet.live[name], principal_of(request.scope).name != ""))


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
]
