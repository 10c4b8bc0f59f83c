"""The async job API: submit, poll (optionally long-poll), stream, cancel."""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.apikeys import Principal
from common.error_codes import ErrorCode
from common.jobs.cancellation import CancelOutcome
from common.jobs.reads import QueueAhead
from common.jobs.record import JobRecord
from common.wire import TERMINAL, JobLinks, JobRequest, JobStatus, JobView
from gateway.auth import principal_of
from gateway.errors import ApiError
from gateway.operations import OBJECT, STRING, Operation, Param, Reply, header
from gateway.request_body import parse_body
from gateway.shards import Shard
from gateway.state import AppState, app_state
from gateway.streaming.departure import until_disconnect
from gateway.streaming.ids import valid_entry_id
from gateway.streaming.job_events import JobEventsResponse
from gateway.streaming.reading import read_position, wait_final
from gateway.streaming.sse import StreamEndpoint
from gateway.streaming.tokens import QUERY_PARAM, StreamTokens
from gateway.submission import submit_job


class JobPage(BaseModel):
    """A page of the caller's jobs; `next_cursor` is the next page's `after`. `unreachable_stores` names
    the Redis stores that did not answer (`store 2`, as /readyz names them): the page leaves their jobs
    out."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)

    object: Literal["list"] = "list"
    data: list[JobView]
    has_more: bool
    next_cursor: str | None
    unreachable_stores: list[str] = Field(default_factory=list)


def links(job_id: str) -> JobLinks:
    return JobLinks(self=f"/v1/jobs/{job_id}", events=f"/v1/jobs/{job_id}/events")


def not_found(job_id: str) -> ApiError:
    message = f"job {job_id!r} does not exist (or has expired)"
    return ApiError(404, message, param="id", code=ErrorCode.job_not_found)


def store_lost(job_id: str) -> ApiError:
    message = (
        f"job {job_id!r} was lost: the job store (Redis) lost its data (it restarted without persistence); "
        "submit the job again"
    )
    return ApiError(503, message, param="id", code=ErrorCode.store_lost)


async def missing(state: AppState, job_id: str) -> ApiError:
    """The error for a job not found: lost with its Redis's data (503 store_lost), or 404."""
    return store_lost(job_id) if await state.shards.lost(job_id) else not_found(job_id)


async def find_job(state: AppState, job_id: str, principal: Principal) -> tuple[Shard, JobRecord]:
    """The job's shard and record as `principal` may see it: another owner's job does not exist for
    them (404, not 403); a job lost with its Redis's data is 503 store_lost."""
    found = await state.shards.owned_record(job_id, principal.name)
    if found is None:
        raise await missing(state, job_id)
    return found


async def load_view(state: AppState, job_id: str, principal: Principal) -> JobView:
    return await view_of(state, *await find_job(state, job_id, principal))


async def view_of(state: AppState, shard: Shard, record: JobRecord) -> JobView:
    """The job's view, with its place in the queue and an estimate of its wait while it is queued."""
    job_id = record.id
    position = eta = None
    if record.status is JobStatus.queued:
        ahead = await shard.queue.queue_ahead(record.model, job_id, record.priority)
        model = (await state.fleet.snapshot()).live.get(record.model)
        if ahead is not None:
            position = ahead.jobs
            eta = queue_eta_s(ahead, model.speed_tokens_per_s if model else 0.0)
    return record.view(links(job_id), position, eta)


def queue_eta_s(ahead: QueueAhead, speed: float) -> float | None:
    """Seconds until a queued job starts: the tokens ahead of it, and a typical job's more (the queue's
    head starts when a running job ends), at the speed its model's workers measured while running jobs;
    None before any worker has measured one."""
    if speed <= 0:
        return None
    return round((ahead.tokens + ahead.typical) / speed, 2)


def job_response(view: JobView, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(view.model_dump(mode="json"), status, headers)


@Operation(
    "Submit a generation job",
    request=JobRequest,
    responses={202: Reply("queued", JobView)},
    errors=(400, 404, 409, 413, 422, 429, 503),
    params=(header("Idempotency-Key"),),
)
async def create_job(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, JobRequest)
    principal = principal_of(request.scope)
    submitted = await submit_job(state, body, request.headers.get("idempotency-key"), principal)
    if submitted.created:  # as submitted: no read back (the record may already say running)
        view = JobView(
            id=submitted.job_id,
            status=JobStatus.queued,
            model=submitted.model,
            created_at=submitted.created_at,
            priority=body.priority,
            links=links(submitted.job_id),
        )
    else:
        view = await load_view(state, submitted.job_id, principal)
    headers = {"Location": view.links.self}
    if not submitted.created:
        headers["Idempotent-Replayed"] = "true"
    return job_response(view, 202, headers)


@Operation(
    "A job's status and result; `wait` long-polls until it ends",
    responses={200: Reply("the job", JobView)},
    errors=(404, 422, 503),
    params=(Param("wait", {"type": "number", "minimum": 0}),),
)
async def get_job(request: Request) -> Response:
    state = app_state(request)
    job_id = request.path_params["job_id"]
    principal = principal_of(request.scope)
    shard, record = await find_job(state, job_id, principal)
    view = await view_of(state, shard, record)
    wait = _wait_seconds(request, state.settings.max_wait_s)
    if wait > 0 and view.status not in TERMINAL:
        with state.streams.slot(principal.name):  # a client that leaves frees its Redis connection at once
            await until_disconnect(request, wait_final_unless_stopping(state, shard, job_id, wait))
        view = await load_view(state, job_id, principal)
    return job_response(view)


async def wait_final_unless_stopping(state: AppState, shard: Shard, job_id: str, wait: float) -> None:
    """Until the job's final event, `wait` seconds, or the gateway being told to stop (the long-poll then
    answers the job as it stands, as at the end of its wait, before the shutdown cuts it)."""
    final = asyncio.ensure_future(wait_final(shard.relay, shard.redis, job_id, wait))
    stopping = asyncio.ensure_future(state.stopping.wait())
    try:
        await asyncio.wait([final, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        final.cancel()
        stopping.cancel()
        await asyncio.gather(final, stopping, return_exceptions=True)
    if final.done() and not final.cancelled() and (error := final.exception()) is not None:
        raise error


def _wait_seconds(request: Request, limit: float) -> float:
    raw = request.query_params.get("wait")
    if raw is None:
        return 0.0
    if not _SECONDS.fullmatch(raw):  # float() would take " 2", "2_0", "nan" and other scripts' digits
        raise ApiError(422, f"wait: {raw[:100]!r} is not a number of seconds", param="wait")
    wait = float(raw)
    if not 0 <= wait <= limit:
        raise ApiError(422, f"wait: must be between 0 and {limit:g} seconds", param="wait")
    return wait


@Operation(
    "SSE: status, token, done/error events; resumable by Last-Event-ID or after",
    responses={200: Reply("event stream", stream=STRING)},
    errors=(404, 422, 503),
    params=(
        Param("after", {"type": "string", "pattern": r"^[0-9]{1,20}-[0-9]{1,20}$"}),
        header("Last-Event-ID"),
    ),
)
async def job_events(request: Request) -> Response:
    state = app_state(request)
    job_id = request.path_params["job_id"]
    shard, _ = await find_job(state, job_id, principal_of(request.scope))
    after = request.query_params.get("after") or request.headers.get("last-event-id") or "0-0"
    if not valid_entry_id(after):
        raise ApiError(422, f"after: {after!r} is not an event id like 1700000000000-0", param="after")
    position = await read_position(shard.redis, shard.keys, job_id, after)
    if position == "beyond":
        raise ApiError(422, f"after: {after!r} is past the newest event of this job", param="after")
    owner = principal_of(request.scope).name
    state.streams.take(owner)
    keepalive_s = state.settings.sse_keepalive_s
    on_end = functools.partial(state.streams.give_back, owner)
    pauses = state.metrics.sse_client_pauses
    past_end = position == "ended"
    return JobEventsResponse(
        shard.relay, shard.redis, job_id, after, keepalive_s, on_end, pauses.inc, past_end=past_end
    )


@Operation(
    "Cancel a job; with purge=true, also delete all of its data at once",
    responses={
        200: Reply("cancelled (or already ended)", JobView),
        202: Reply("running; it stops within one engine step", JobView),
        204: Reply("purged"),
    },
    errors=(404, 503),
    params=(Param("purge", {"type": "boolean"}),),
)
async def cancel_job(request: Request) -> Response:
    state = app_state(request)
    job_id = request.path_params["job_id"]
    principal = principal_of(request.scope)
    shard, record = await find_job(state, job_id, principal)
    if request.query_params.get("purge", "false").lower() in ("1", "true", "yes"):
        if not await shard.queue.purge(job_id, record.model):
            raise await missing(state, job_id)
        return Response(status_code=204)
    outcome = await shard.queue.cancel(job_id, record.model)
    if outcome is CancelOutcome.missing:
        raise await missing(state, job_id)
    view = await load_view(state, job_id, principal)
    return job_response(view, 202 if outcome is CancelOutcome.cancelling else 200)


@Operation(
    "The caller's jobs, newest first, a page at a time",
    responses={200: Reply("a page of jobs", JobPage)},
    errors=(422,),
    params=(
        Param("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
        Param("after", {"type": "string", "pattern": r"^[0-9]+\.[A-Za-z0-9_-]+$"}),
    ),
)
async def list_jobs(request: Request) -> Response:
    """The caller's jobs, newest first; `after` is the `next_cursor` of the page before. A store that does
    not answer is named in `unreachable_stores` and its jobs left out (503 when none answers)."""
    state = app_state(request)
    principal = principal_of(request.scope)
    limit = _int_param(request, "limit", 20, 1, 100)
    owner = principal.name
    upper, last_id = "+inf", None
    after = request.query_params.get("after")
    if after is not None:
        cursor = _CURSOR.fullmatch(after)
        if cursor is None:
            raise ApiError(422, f"after: {after!r} is not a cursor from next_cursor", param="after")
        upper, last_id = cursor.groups()
    named = state.shards.named()
    pages = await asyncio.gather(
        *(_page(shard, shard.keys.owner_jobs(owner), upper, last_id, limit + 1) for _, shard in named),
        return_exceptions=True,
    )
    silent = _unanswered(named, pages)
    if len(silent) == len(named):
        raise silent[0][1]
    unreachable = {name for name, _ in silent}
    read = (page for page in pages if not isinstance(page, BaseException))
    entries = sorted((entry for page in read for entry in page), key=lambda e: (e[0], e[1]), reverse=True)
    page = entries[:limit]
    views = []
    for _score, job_id, shard in page:
        try:
            record = await shard.queue.record(job_id)
        except RedisError:  # gone since its page was read: named with the others
            unreachable.add(next(name for name, other in named if other is shard))
            continue
        if record is not None and record.owner == principal.name:
            views.append(record.view(links(job_id)))
    has_more = len(entries) > limit
    cursor_out = f"{int(page[-1][0])}.{page[-1][1]}" if has_more and page else None
    said = [name for name, _ in named if name in unreachable]
    listed = JobPage(data=views, has_more=has_more, next_cursor=cursor_out, unreachable_stores=said)
    return JSONResponse(listed.model_dump(mode="json"))


def _unanswered(
    named: list[tuple[str, Shard]], pages: list[list[tuple[float, str, Shard]] | BaseException]
) -> list[tuple[str, RedisError]]:
    """Each store whose page could not be read, named, with its error (any other error is raised)."""
    silent: list[tuple[str, RedisError]] = []
    for (name, _), page in zip(named, pages, strict=True):
        if isinstance(page, RedisError):
            silent.append((name, page))
        elif isinstance(page, BaseException):
            raise page
    return silent


async def _page(
    shard: Shard, index: str, upper: str, last_id: str | None, count: int
) -> list[tuple[float, str, Shard]]:
    """Up to `count` of one shard's entries of the owner's index, newest first, after the cursor."""
    skip = 0
    if last_id is not None:
        # Jobs submitted in the same millisecond share a score; Redis orders them by id, so the page
        # goes on after the cursor's job among them.
        same: list[str] = await shard.redis.zrangebyscore(index, upper, upper)
        skip = sum(1 for job_id in same if job_id >= last_id)
    entries = await shard.redis.zrevrangebyscore(index, upper, "-inf", start=skip, num=count, withscores=True)
    return [(score, job_id, shard) for job_id, score in entries]


_SECONDS = re.compile(r"(?:[0-9]{1,9}(?:\.[0-9]{0,9})?|\.[0-9]{1,9})", re.ASCII)
_CURSOR = re.compile(r"([0-9]{1,16})\.([A-Za-z0-9_-]{1,64})", re.ASCII)


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or not low <= int(raw) <= high:
        raise ApiError(422, f"{name}: must be a whole number from {low} to {high}", param=name)
    return int(raw)


@Operation(
    "A signed token that opens the job's events from a browser's EventSource",
    responses={201: Reply("token, expires_at and events_url", OBJECT)},
    errors=(404, 501),
)
async def create_stream_token(request: Request) -> Response:
    state = app_state(request)
    tokens: StreamTokens | None = request.app.state.stream_tokens
    job_id = request.path_params["job_id"]
    principal = principal_of(request.scope)
    await load_view(state, job_id, principal)
    if tokens is None:
        raise ApiError(
            501,
            "stream tokens need ORTFLEET_STREAM_TOKEN_SECRET set on every gateway",
            code=ErrorCode.stream_tokens_disabled,
        )
    token, expires = tokens.issue(job_id, principal.name)
    events = f"/v1/jobs/{job_id}/events?{QUERY_PARAM}={token}"
    return JSONResponse({"token": token, "expires_at": expires, "events_url": events}, 201)


routes = [
    Route("/v1/jobs", create_job, methods=["POST"]),
    Route("/v1/jobs", list_jobs, methods=["GET"]),
    Route("/v1/jobs/{job_id}", get_job, methods=["GET"]),
    Route("/v1/jobs/{job_id}", cancel_job, methods=["DELETE"]),
    Route("/v1/jobs/{job_id}/events", StreamEndpoint(job_events), methods=["GET"]),
    Route("/v1/jobs/{job_id}/stream-token", create_stream_token, methods=["POST"]),
]
