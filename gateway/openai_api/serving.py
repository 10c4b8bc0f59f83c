"""What chat and text completions share: the served model, waiting on the jobs, client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import CLIENT_CLOSED_REQUEST, ApiError, ClientGone
from gateway.openai_api.choices import JOB_ID_HEADER, Choices, as_openai_error
from gateway.openai_api.streaming import JobStreamResponse, ResponseFormat, chunks
from gateway.state import AppState
from gateway.submission import resolve_model

T = TypeVar("T")


async def served_model(state: AppState, requested: str | None) -> str:
    try:
        model, _context = await resolve_model(state, requested)
    except ApiError as e:
        raise as_openai_error(e) from e
    return model


async def respond(
    request: Request,
    choices: Choices,
    form: ResponseFormat,
    *,
    stream: bool,
    include_usage: bool,
    continuous_usage: bool = False,
) -> Response:
    """The whole response once every job ended, or (stream) SSE chunks as they generate.

    A streamed response is held back until every job has started, for at most the SSE keep-alive
    interval, so a job that fails before it starts still gets a proper HTTP error. A client that
    disconnects at any point cancels the jobs.
    """
    headers = {JOB_ID_HEADER: ",".join(choices.job_ids)}
    hold_s = choices.state.settings.sse_keepalive_s
    events = choices.events(hold_s)
    try:
        if stream:
            seen = await until_disconnect(request, choices.wait_started(events, hold_s))
        else:
            results = await until_disconnect(request, choices.results(events))
    except ClientGone:
        choices.release()
        await choices.cancel()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException:
        choices.release()
        await events.aclose()
        raise
    if stream:
        content = chunks(choices, seen, events, form, include_usage, continuous_usage)
        return JobStreamResponse(content, choices, events, headers)  # releases the slot when it ends
    choices.release()
    usage = choices.total_usage([result.usage for result in results])
    return JSONResponse(form.complete(results, usage).model_dump(mode="json"), headers=headers)


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; ClientGone, with `work` cancelled, if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    # Not awaited: a Redis read with a socket timeout may finish its round before it sees the cancel,
    # and the client is gone now, not then.
    task.add_done_callback(_retrieve)
    raise ClientGone


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
