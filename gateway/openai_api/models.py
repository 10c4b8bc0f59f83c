"""`GET /v1/models` and `GET /v1/models/{id}`: the models served by live workers, in OpenAI's shape, and
each of their LoRA adapters as a model of its own whose `parent` is its model (vLLM's shape)."""

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


def adapter_entry(name: str, m: ModelState) -> dict[str, Any]:
    """A LoRA adapter of the model `m`, as vLLM lists one: its folder as `root`, its model as `parent`."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "ortfleet",
        "root": m.adapters[name],
        "parent": m.name,
        "max_model_len": m.context_length,
        "context_length": m.context_length,
        "tool_prompt": TOOL_PROMPT,
    }


def served_entries(m: ModelState, tenant: bool) -> list[dict[str, Any]]:
    """The model's entry, then its adapters'."""
    return [model_entry(m, tenant), *(adapter_entry(name, m) for name in sorted(m.adapters))]


@Operation("Models served by live workers", responses={200: Reply("models")})
async def list_models(request: Request) -> Response:
    fleet = await app_state(request).fleet.snapshot(fresh=True)
    tenant = principal_of(request.scope).name != ""
    data = [
        entry
        for m in sorted(fleet.live.values(), key=lambda m: m.name)
        for entry in served_entries(m, tenant)
        if entry["id"] == m.name or entry["id"] in fleet.adapters
    ]
    return JSONResponse({"object": "list", "data": data})


@Operation(
    "One model served by live workers (OpenAI's shape)",
    responses={200: Reply("the model"), 404: Reply("not served", Error)},
)
async def retrieve_model(request: Request) -> Response:
    name = request.path_params["model_id"]
    fleet = await app_state(request).fleet.snapshot(fresh=True)
    parent = fleet.live.get(fleet.adapters.get(name, ""))
    if name not in fleet.live and parent is not None and name in parent.adapters:
        return JSONResponse(adapter_entry(name, parent))
    if name not in fleet.live:
        message = f"model {name!r} is not served by a live worker"
        raise ApiError(404, message, param="model", code=ErrorCode.model_not_found)
    return JSONResponse(model_entry(fleet.live[name], principal_of(request.scope).name != ""))


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
]
