"""OpenAI's Batch API: `POST/GET /v1/batches`, `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`."""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.error_codes import ErrorCode
from gateway.auth import principal_of
from gateway.batches.lines import ENDPOINTS
from gateway.batches.state import Batch, BatchState, BatchStatus, new_batch_id
from gateway.errors import ApiError
from gateway.files.routes import file_store
from gateway.files.store import new_file_id
from gateway.metadata import Metadata
from gateway.operations import OBJECT, Operation, Param, Reply, page_of
from gateway.owned import OwnedKind, list_page, page_limit
from gateway.request_body import parse_body
from gateway.state import app_state

MAX_LIST = 100


class BatchRequest(BaseModel):
    """Body of `POST /v1/batches`."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(..., min_length=1, description="A file uploaded with purpose `batch`.")
    endpoint: str = Field(..., description="/v1/chat/completions or /v1/completions.")
    completion_window: Literal["24h"] = Field(..., description="The only window offered: 24h.")
    metadata: Metadata | None = Field(
        None, description="Up to 16 string pairs; keys up to 64 characters, values up to 512."
    )


def batch_state(request: Request) -> BatchState:
    state = app_state(request)
    return BatchState(state.redis, state.keys, state.settings.file_ttl_s)


_BATCH = Reply("the batch", OBJECT)

BATCH = OwnedKind("batch", "batch_id", ErrorCode.batch_not_found, "batch_")


async def owned_batch(request: Request) -> Batch:
    states = batch_state(request)
    return await BATCH.from_path(request, lambda batch_id, _owner: states.load(batch_id))


@Operation(
    "Start a batch over an uploaded file; its lines run as jobs of the batch class",
    request=BatchRequest,
    responses={200: _BATCH},
    errors=(400, 404),
)
async def create_batch(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, BatchRequest, invalid_status=400)
    if body.endpoint not in ENDPOINTS:
        raise ApiError(
            400,
            f"endpoint: {body.endpoint!r} is not supported; use {' or '.join(ENDPOINTS)}",
            param="endpoint",
        )
    principal = principal_of(request.scope)
    files = file_store(request)
    source = await files.get(body.input_file_id, principal.name)
    if source is None:
        raise ApiError(
            404, f"input_file_id: file {body.input_file_id!r} does not exist", param="input_file_id"
        )
    if source.purpose != "batch":
        raise ApiError(400, "input_file_id: the file's purpose must be 'batch'", param="input_file_id")
    now = time.time()
    expires_at = now + state.settings.batch_window_s
    fields = {
        "id": new_batch_id(),
        "owner": principal.name,
        "owner_max_jobs": str(principal.max_concurrent_jobs or 0),
        "owner_max_prompt_tokens": str(principal.max_prompt_tokens_in_flight or 0),
        "status": BatchStatus.validating.value,
        "input_file_id": source.id,
        "endpoint": body.endpoint,
        "completion_window": body.completion_window,
        "created_at": f"{now:.3f}",
        "expires_at": f"{expires_at:.3f}",
        "output_file_id": new_file_id(),
        "error_file_id": new_file_id(),
        "total": "0",
        "completed": "0",
        "failed": "0",
        "next": "0",
    }
    if body.metadata is not None:
        fields["metadata"] = json.dumps(body.metadata)
    batch = await batch_state(request).create(fields, expires_at)
    if batch is None:  # deleted since it was read
        raise ApiError(
            404, f"input_file_id: file {body.input_file_id!r} does not exist", param="input_file_id"
        )
    state.batch_created.set()
    return JSONResponse(batch.view())


@Operation("A batch's status, request counts and files", responses={200: _BATCH}, errors=(404,))
async def get_batch(request: Request) -> Response:
    return JSONResponse((await owned_batch(request)).view())


@Operation(
    "The caller's batches, newest first",
    responses={200: Reply("batches", page_of("batches"))},
    errors=(400,),
    params=(Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIST}), Param("after")),
)
async def list_batches(request: Request) -> Response:
    limit = page_limit(request, default=20, most=MAX_LIST)
    owner = principal_of(request.scope).name
    found = await batch_state(request).list_batches(owner, limit + 1, BATCH.page_after(request))
    return list_page(found, limit)


@Operation(
    "Cancel a batch: no line fed any more, queued ones cancelled, running ones finish",
    responses={200: _BATCH},
    errors=(404,),
)
async def cancel_batch(request: Request) -> Response:
    """Stops feeding lines and cancels the queued ones; running lines finish (as OpenAI's)."""
    batch = await owned_batch(request)
    fields = {"cancelling_at": f"{time.time():.3f}", "outcome": BatchStatus.cancelled.value}
    states = batch_state(request)
    await states.move(
        batch.id,
        from_statuses={BatchStatus.validating, BatchStatus.in_progress},
        to=BatchStatus.cancelling,
        fields=fields,
    )
    batch = await states.load(batch.id) or batch
    return JSONResponse(batch.view())


routes = [
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
]
