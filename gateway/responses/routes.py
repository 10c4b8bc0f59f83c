"""OpenAI's Responses API: create (foreground, streamed or background; continuing a stored response),
retrieve (or replay its events after `starting_after`), list its input items, cancel, delete. A response
is an ortfleet job underneath."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import secrets
import time

import anyio
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from common.apikeys import Principal
from common.error_codes import ErrorCode
from common.jobs.cancellation import CancelOutcome
from common.jobs.record import JobRecord
from common.wire import TERMINAL, JobStatus
from gateway.auth import principal_of
from gateway.errors import ApiError, ClientGone
from gateway.openai_api.choices import as_openai_error, job_failure
from gateway.openai_api.serving import served_model
from gateway.openai_api.structured import with_schema_shown
from gateway.openai_api.tools import check_schemas, with_tools
from gateway.operations import OBJECT, Events, Operation, Param, Reply, page_of
from gateway.request_body import parse_body
from gateway.responses import store
from gateway.responses.events import EventFrames
from gateway.responses.items import conversation, normalized_input
from gateway.responses.output import response_id, view_from_job
from gateway.responses.protocol import (
    ResponseRequest,
    check_supported,
    echoed_format,
    echoed_tools,
    in_responses_terms,
    output_format,
    response_job,
    tool_plan,
)
from gateway.state import AppState, app_state
from gateway.streaming.departure import until_disconnect
from gateway.streaming.job_events import JobEventsResponse
from gateway.streaming.reading import wait_final
from gateway.streaming.sse import StreamEndpoint
from gateway.submission import ServedModel, submit_job

CANCEL_WAIT_S = 5.0


_SEQUENCE_NUMBER = re.compile(r"-1|[0-9]{1,18}", re.ASCII)
MAX_ITEMS_PAGE = 100

_EVENTS = Events("the event as JSON", named=True, about="one server-sent event of OpenAI's Responses stream")


class ResponseEventStream(JobEventsResponse):
    """A response's events (EventFrames) after `starting_after`, relayed from its job's stream. The
    stream holds one of its key's stream slots, taken by the caller, until it ends; a foreground
    response (`owned`) whose client leaves first is cancelled, and an unstored one is forgotten."""

    def __init__(
        self, state: AppState, meta: dict[str, str], starting_after: int, owner: str, owned: bool
    ) -> None:
        self._state = state
        self._shard = state.shards.of_job(meta["job_id"], meta["model"])
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
            # a stream ended by its Redis staying away (store_unavailable) leaves the job to its TTL
            with contextlib.suppress(RedisError):
                if self._owned and not self.ended and self._meta["store"] == "1":
                    with anyio.CancelScope(shield=True):
                        await self._shard.queue.cancel(self._meta["job_id"], self._meta["model"])
                await store.forget_unstored(self._state, self._meta)


async def _submit(
    state: AppState, body: ResponseRequest, served: ServedModel, principal: Principal
) -> dict[str, str]:
    """Submits the response's job and stores the response's record (unless `store` is false), which it
    returns."""
    plan = tool_plan(body)
    earlier = []
    if body.previous_response_id is not None:
        earlier = await store.earlier_items(state, body.previous_response_id, principal.name)
    own = normalized_input(body.input, secrets.token_hex(12))
    tool_turns = any(item["type"] != "message" for item in [*earlier, *own])
    guided = output_format(body, plan, tool_turns)
    if plan is not None and plan.calls_allowed:
        await check_schemas(plan)
    messages = with_tools(conversation(body.instructions, earlier, own), plan)
    messages = with_schema_shown(messages, guided, state.settings.structured_output_prompt)
    try:
        submitted = await submit_job(
            state, response_job(body, served.name, messages, guided), None, principal
        )
    except ApiError as e:
        raise in_responses_terms(as_openai_error(e)) from e
    resp_id = response_id(submitted.job_id)
    meta = {
        "id": resp_id,
        "job_id": submitted.job_id,
        "owner": principal.name,
        "model": served.model,
        "adapter": served.adapter or "",
        "created_at": f"{submitted.created_at:.3f}",
        "background": "1" if body.background else "0",
        "store": "1" if body.stored else "0",
        "instructions": body.instructions or "",
        "max_output_tokens": str(body.max_output_tokens or ""),
        "temperature": "" if body.temperature is None else str(body.temperature),
        "top_p": "" if body.top_p is None else str(body.top_p),
        "metadata": json.dumps(body.metadata or {}),
        "previous_response_id": body.previous_response_id or "",
        "input": json.dumps([*earlier, *own], ensure_ascii=False),
        "tools": json.dumps(echoed_tools(plan)),
        "tool_choice": json.dumps(body.tool_choice if body.tool_choice is not None else "auto"),
        "parallel_tool_calls": "0" if body.parallel_tool_calls is False else "1",
        "calls": "1" if plan is not None and plan.calls_allowed else "0",
        "text_format": json.dumps(echoed_format(body)),
        "logprobs": "1" if body.logprobs else "0",
        "top_logprobs": "" if body.top_logprobs is None else str(body.top_logprobs),
    }
    await store.save_meta(state, meta)
    return meta


@Operation(
    "Create a response (text, function tools, structured text): foreground, streamed or in the background; "
    "`previous_response_id` continues a stored one",
    request=ResponseRequest,
    responses={200: Reply("the response; with `stream`, its events as SSE", OBJECT, stream=_EVENTS)},
    errors=(400, 404, 429, 503),
)
async def create_response(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, ResponseRequest, invalid_status=400)
    check_supported(body)
    served = await served_model(state, body.model)
    model = served.model
    principal = principal_of(request.scope)
    if body.background and not body.stream:
        meta = await _submit(state, body, served, principal)
        queued = JobRecord(meta["job_id"], model, JobStatus.queued, float(meta["created_at"]))
        return JSONResponse(view_from_job(meta, queued))
    # a call that waits for its response holds one of its key's stream slots: 429 before it submits
    state.streams.take(principal.name)
    try:
        meta = await _submit(state, body, served, principal)
    except BaseException:
        state.streams.give_back(principal.name)
        raise
    if body.stream:  # the stream gives the slot back when it ends
        return ResponseEventStream(state, meta, -1, principal.name, owned=not body.background)
    try:
        await until_disconnect(request, _until_final(state, model, meta["job_id"]))
    except ClientGone:
        await state.shards.of_job(meta["job_id"], model).queue.cancel(meta["job_id"], model)
        await store.forget_unstored(state, meta)
        return Response(status_code=499)
    finally:
        state.streams.give_back(principal.name)
    record = await state.shards.of_job(meta["job_id"], model).queue.record(meta["job_id"])
    logprobs = await store.job_logprobs(state, meta) if record is not None else None
    await store.forget_unstored(state, meta)
    if record is None:  # purged (or expired) meanwhile
        raise job_failure(meta["job_id"], "was purged", ErrorCode.job_purged, "input")
    if record.status is JobStatus.failed:  # a call that waited for its response is answered an error
        raise in_responses_terms(job_failure(meta["job_id"], record.error, record.error_code, "input"))
    return JSONResponse(view_from_job(meta, record, logprobs))


async def _until_final(state: AppState, model: str, job_id: str) -> None:
    shard = state.shards.of_job(job_id, model)
    while True:
        await wait_final(shard.relay, shard.redis, job_id, state.settings.max_wait_s)
        record = await shard.queue.record(job_id)
        if record is None or record.status in TERMINAL:
            return


@Operation(
    "A response; with stream=true its events after `starting_after`, from any gateway",
    responses={200: Reply("the response, or its events as SSE", OBJECT, stream=_EVENTS)},
    errors=(400, 404),
    params=(Param("stream", {"type": "boolean"}), Param("starting_after", {"type": "integer"})),
)
async def get_response(request: Request) -> Response:
    state = app_state(request)
    resp_id = request.path_params["response_id"]
    meta = await store.load_meta(state, resp_id, principal_of(request.scope).name)
    if request.query_params.get("stream", "false").lower() not in ("true", "1"):
        return JSONResponse(await store.current_view(state, meta))
    raw = request.query_params.get("starting_after", "-1")
    if not _SEQUENCE_NUMBER.fullmatch(raw):
        message = f"starting_after: {raw[:100]!r} is not a sequence number (0 or more, or -1: every event)"
        raise ApiError(400, message, param="starting_after")
    starting_after = int(raw)
    state.streams.take(meta["owner"])
    return ResponseEventStream(state, meta, starting_after, meta["owner"], owned=False)


@Operation("Cancel a background response", responses={200: Reply("the response", OBJECT)}, errors=(400, 404))
async def cancel_response(request: Request) -> Response:
    state = app_state(request)
    resp_id = request.path_params["response_id"]
    meta = await store.load_meta(state, resp_id, principal_of(request.scope).name)
    if meta.get("background") != "1":
        raise ApiError(400, "only a background response can be cancelled", param="response_id")
    shard = state.shards.of_job(meta["job_id"], meta["model"])
    outcome = await shard.queue.cancel(meta["job_id"], meta["model"])
    if outcome is CancelOutcome.cancelling:
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            await wait_final(shard.relay, shard.redis, meta["job_id"], deadline - time.monotonic())
            record = await shard.queue.record(meta["job_id"])
            if record is None or record.status in TERMINAL:
                break
    return JSONResponse(await store.current_view(state, meta))


@Operation("Delete a stored response and its job", responses={200: Reply("deleted", OBJECT)}, errors=(404,))
async def delete_response(request: Request) -> Response:
    state = app_state(request)
    resp_id = request.path_params["response_id"]
    meta = await store.load_meta(state, resp_id, principal_of(request.scope).name)
    await store.delete(state, meta)
    return JSONResponse({"id": resp_id, "object": "response.deleted", "deleted": True})


@Operation(
    "A response's input items (its whole conversation), a page at a time",
    responses={200: Reply("input items", page_of("input items"))},
    errors=(400, 404),
    params=(
        Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_ITEMS_PAGE}),
        Param("order", {"enum": ["asc", "desc"]}),
        Param("after"),
    ),
)
async def list_input_items(request: Request) -> Response:
    """The response's input items a page at a time, newest first unless `order=asc`, after the item
    `after` (an id of the list)."""
    state = app_state(request)
    resp_id = request.path_params["response_id"]
    meta = await store.load_meta(state, resp_id, principal_of(request.scope).name)
    query = request.query_params
    raw_limit = query.get("limit", "20")
    if not raw_limit.isascii() or not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_ITEMS_PAGE:
        raise ApiError(
            400, f"limit: {raw_limit[:20]!r} is not a whole number from 1 to {MAX_ITEMS_PAGE}", param="limit"
        )
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: {order[:20]!r} is not 'asc' or 'desc'", param="order")
    items = store.stored_items(meta)
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"after: {after[:100]!r} is not an input item of {resp_id}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(raw_limit)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", StreamEndpoint(get_response), methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
    Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
]
