"""OpenAI's Responses API (text only): create (foreground, streamed or background), retrieve (or replay
its events after `starting_after`), cancel. A response is an ortfleet job underneath."""

from __future__ import annotations

import functools
import json
import re
import time
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from common import keys
from common.apikeys import Principal
from common.error_codes import ErrorCode
from common.records import JobRecord
from common.wire import TERMINAL, JobStatus
from gateway.auth import principal_of
from gateway.departure import until_disconnect
from gateway.errors import ApiError, ClientGone
from gateway.openai_api.choices import as_openai_error, job_failure
from gateway.openai_api.serving import served_model
from gateway.owned import OwnedKind
from gateway.request_body import parse_body
from gateway.responses.events import EventFrames, response_id, view_from_job
from gateway.responses.protocol import ResponseRequest, check_supported, in_responses_terms, response_job
from gateway.sse import JobEventsResponse, StreamEndpoint, wait_final
from gateway.state import AppState, app_state
from gateway.submission import submit_job

CANCEL_WAIT_S = 5.0


RESPONSE = OwnedKind("response", "response_id", ErrorCode.response_not_found, "resp_")
_SEQUENCE_NUMBER = re.compile(r"-1|[0-9]{1,18}", re.ASCII)


async def load_meta(state: AppState, resp_id: str, owner: str) -> dict[str, str]:
    meta: dict[str, str] = await state.redis.hgetall(keys.response(resp_id))  # type: ignore[misc]
    if not meta or meta.get("owner", "") != owner or meta.get("store") != "1":
        raise RESPONSE.not_found(resp_id)
    return meta


async def current_view(state: AppState, meta: dict[str, str]) -> dict[str, Any]:
    return view_from_job(meta, await state.shards.of_model(meta["model"]).queue.record(meta["job_id"]))


async def forget_unstored(state: AppState, meta: dict[str, str]) -> None:
    """Deletes the job of a response created with `store: false` once it has been answered (or its
    client left): as on OpenAI, such a response cannot be retrieved later, as a response or a job."""
    if meta["store"] != "1":
        with anyio.CancelScope(shield=True):
            await state.shards.of_model(meta["model"]).queue.purge(meta["job_id"], meta["model"])


class ResponseEventStream(JobEventsResponse):
    """A response's events (EventFrames) after `starting_after`, relayed from its job's stream. The
    stream holds one of its key's stream slots, taken by the caller, until it ends; a foreground
    response (`owned`) whose client leaves first is cancelled, and an unstored one is forgotten."""

    def __init__(
        self, state: AppState, meta: dict[str, str], starting_after: int, owner: str, owned: bool
    ) -> None:
        self._state = state
        self._shard = state.shards.of_model(meta["model"])
        self._meta = meta
        self._owned = owned
        render = EventFrames(meta, starting_after)
        super().__init__(
            self._shard.relay,
            self._shard.redis,
            meta["job_id"],
            "0-0",
            state.settings.sse_keepalive_s,
            functools.partial(state.streams.give_back, owner),
            state.metrics.sse_client_pauses.inc,
            render=render,
            opening=render.opening(),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._owned and not self.ended and self._meta["store"] == "1":
                with anyio.CancelScope(shield=True):
                    await self._shard.queue.cancel(self._meta["job_id"], self._meta["model"])
            await forget_unstored(self._state, self._meta)


async def _submit(state: AppState, body: ResponseRequest, model: str, principal: Principal) -> dict[str, str]:
    """Submits the response's job and stores the response's record (unless `store` is false), which it
    returns."""
    try:
        submitted = await submit_job(state, response_job(body, model), None, principal)
    except ApiError as e:
        raise in_responses_terms(as_openai_error(e)) from e
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
    if body.stored:
        await state.redis.hset(keys.response(resp_id), mapping=meta)  # type: ignore[misc]
        await state.redis.expire(keys.response(resp_id), state.settings.job_ttl_s)
    return meta


async def create_response(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, ResponseRequest, invalid_status=400)
    check_supported(body)
    model = await served_model(state, body.model)
    principal = principal_of(request.scope)
    if body.background and not body.stream:
        meta = await _submit(state, body, model, principal)
        queued = JobRecord(meta["job_id"], model, JobStatus.queued, float(meta["created_at"]))
        return JSONResponse(view_from_job(meta, queued))
    # a call that waits for its response holds one of its key's stream slots: 429 before it submits
    state.streams.take(principal.name)
    try:
        meta = await _submit(state, body, model, principal)
    except BaseException:
        state.streams.give_back(principal.name)
        raise
    if body.stream:  # the stream gives the slot back when it ends
        return ResponseEventStream(state, meta, -1, principal.name, owned=not body.background)
    try:
        await until_disconnect(request, _until_final(state, model, meta["job_id"]))
    except ClientGone:
        await state.shards.of_model(model).queue.cancel(meta["job_id"], model)
        await forget_unstored(state, meta)
        return Response(status_code=499)
    finally:
        state.streams.give_back(principal.name)
    record = await state.shards.of_model(model).queue.record(meta["job_id"])
    await forget_unstored(state, meta)
    if record is None:  # purged (or expired) meanwhile
        raise job_failure(meta["job_id"], "was purged", ErrorCode.job_purged, "input")
    if record.status is JobStatus.failed:  # a call that waited for its response is answered an error
        raise job_failure(meta["job_id"], record.error, record.error_code, "input")
    return JSONResponse(view_from_job(meta, record))


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
    if not _SEQUENCE_NUMBER.fullmatch(raw):
        message = f"starting_after: {raw[:100]!r} is not a sequence number (0 or more, or -1: every event)"
        raise ApiError(400, message, param="starting_after")
    starting_after = int(raw)
    state.streams.take(meta["owner"])
    return ResponseEventStream(state, meta, starting_after, meta["owner"], owned=False)


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
