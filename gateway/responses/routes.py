"""OpenAI's Responses API (text only): create (foreground, streamed or background), retrieve (or replay
its events after `starting_after`), cancel. A response is an ortfleet job underneath."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from common import keys
from common.error_codes import ErrorCode
from common.records import JobRecord
from common.wire import TERMINAL, JobStatus
from gateway.auth import principal_of
from gateway.departure import until_disconnect
from gateway.errors import ApiError, ClientGone
from gateway.openai_api.choices import as_openai_error
from gateway.openai_api.serving import served_model
from gateway.owned import OwnedKind
from gateway.request_body import parse_body
from gateway.responses.events import EventNumbering, response_id, view_from_job
from gateway.responses.protocol import ResponseRequest, check_supported, response_job
from gateway.sse import KEEPALIVE, EventStreamResponse, StreamEndpoint, batches, wait_final
from gateway.state import AppState, app_state
from gateway.submission import submit_job

CANCEL_WAIT_S = 5.0


RESPONSE = OwnedKind("response", "response_id", ErrorCode.response_not_found)


async def load_meta(state: AppState, resp_id: str, owner: str) -> dict[str, str]:
    meta: dict[str, str] = await state.redis.hgetall(keys.response(resp_id))  # type: ignore[misc]
    if not meta or meta.get("owner", "") != owner or meta.get("store") != "1":
        raise RESPONSE.not_found(resp_id)
    return meta


async def current_view(state: AppState, meta: dict[str, str]) -> dict[str, Any]:
    return view_from_job(meta, await state.shards.of_model(meta["model"]).queue.record(meta["job_id"]))


def sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def events(state: AppState, meta: dict[str, str], starting_after: int) -> AsyncIterator[bytes]:
    """The response's events after `starting_after` (-1: all), derived from its job's stream."""
    numbering = EventNumbering(meta)

    def piece(events: Iterable[dict[str, Any]]) -> bytes:
        return b"".join(sse(event) for event in events if event["sequence_number"] > starting_after)

    if opening := piece(numbering.opening()):
        yield opening
    shard = state.shards.of_model(meta["model"])
    read = batches(shard.relay, shard.redis, meta["job_id"], "0-0", state.settings.sse_keepalive_s)
    async with contextlib.aclosing(read):
        async for batch in read:  # the entries of one read go out in one piece
            if batch is None:
                yield KEEPALIVE
                continue
            if arrived := piece(event for entry in batch for event in numbering.entry(entry[1])):
                yield arrived


class EventStream(EventStreamResponse):
    """Server-sent events of a response; a foreground response whose client leaves is cancelled."""

    def __init__(
        self, content: AsyncIterator[bytes], state: AppState, meta: dict[str, str], owned: bool
    ) -> None:
        self._state = state
        self._meta = meta
        self._owned = owned
        super().__init__(content)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._owned and not self.ended:
                with anyio.CancelScope(shield=True):
                    shard = self._state.shards.of_model(self._meta["model"])
                    await shard.queue.cancel(self._meta["job_id"], self._meta["model"])


async def create_response(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, ResponseRequest, invalid_status=400)
    check_supported(body)
    model = await served_model(state, body.model)
    job = response_job(body, model)
    principal = principal_of(request.scope)
    try:
        submitted = await submit_job(state, job, None, principal)
    except ApiError as e:
        raise as_openai_error(e) from e
    resp_id = response_id(submitted.job_id)
    meta = {
        "id": resp_id,
        "job_id": submitted.job_id,
        "owner": principal.name,
        "model": model,
        "created_at": f"{submitted.created_at:.3f}",
        "background": "1" if body.background else "0",
        "store": "1" if body.stored else "0",
        "instructions": body.instructions or "",
        "max_output_tokens": str(body.max_output_tokens or ""),
        "temperature": "" if body.temperature is None else str(body.temperature),
        "top_p": "" if body.top_p is None else str(body.top_p),
        "metadata": json.dumps(body.metadata or {}),
    }
    await state.redis.hset(keys.response(resp_id), mapping=meta)  # type: ignore[misc]
    await state.redis.expire(keys.response(resp_id), state.settings.job_ttl_s)
    if body.stream:
        return EventStream(events(state, meta, -1), state, meta, owned=not body.background)
    if body.background:
        queued = JobRecord(submitted.job_id, model, JobStatus.queued, submitted.created_at)
        return JSONResponse(view_from_job(meta, queued))
    try:
        await until_disconnect(request, _until_final(state, model, submitted.job_id))
    except ClientGone:
        await state.shards.of_model(model).queue.cancel(submitted.job_id, model)
        return Response(status_code=499)
    return JSONResponse(await current_view(state, meta))


async def _until_final(state: AppState, model: str, job_id: str) -> None:
    shard = state.shards.of_model(model)
    while True:
        await wait_final(shard.relay, shard.redis, job_id, state.settings.max_wait_s)
        record = await shard.queue.record(job_id)
        if record is None or record.status in TERMINAL:
            return


async def get_response(request: Request) -> Response:
    state = app_state(request)
    resp_id = request.path_params["response_id"]
    meta = await load_meta(state, resp_id, principal_of(request.scope).name)
    if request.query_params.get("stream", "false").lower() not in ("true", "1"):
        return JSONResponse(await current_view(state, meta))
    raw = request.query_params.get("starting_after", "-1")
    try:
        starting_after = int(raw)
    except ValueError as e:
        raise ApiError(
            400, f"starting_after: {raw!r} is not a sequence number", param="starting_after"
        ) from e
    return EventStream(events(state, meta, starting_after), state, meta, owned=False)


async def cancel_response(request: Request) -> Response:
    state = app_state(request)
    resp_id = request.path_params["response_id"]
    meta = await load_meta(state, resp_id, principal_of(request.scope).name)
    if meta.get("background") != "1":
        raise ApiError(400, "only a background response can be cancelled", param="response_id")
    shard = state.shards.of_model(meta["model"])
    outcome = await shard.queue.cancel(meta["job_id"], meta["model"])
    if outcome == "cancelling":
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            await wait_final(shard.relay, shard.redis, meta["job_id"], deadline - time.monotonic())
            record = await shard.queue.record(meta["job_id"])
            if record is None or record.status in TERMINAL:
                break
    return JSONResponse(await current_view(state, meta))


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", StreamEndpoint(get_response), methods=["GET"]),
    Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
]
