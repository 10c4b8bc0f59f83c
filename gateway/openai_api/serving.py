"""What chat and text completions share: the served model, waiting on the jobs (a client that leaves
cancels them)."""

from __future__ import annotations

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common.wire import JobRequest
from gateway.auth import principal_of
from gateway.errors import CLIENT_CLOSED_REQUEST, ApiError, ClientGone
from gateway.openai_api.choices import JOB_ID_HEADER, Choices, as_openai_error
from gateway.openai_api.protocol import GenerationParams
from gateway.openai_api.streaming import ChunkStream, JobStreamResponse, ResponseFormat
from gateway.operations import Events, Operation, Reply
from gateway.state import AppState, app_state
from gateway.stopping import GatewayStopping, shutting_down, unless_stopping
from gateway.streaming.departure import until_disconnect
from gateway.submission import ServedModel, resolve_model


def completion_operation(
    summary: str, request: type[BaseModel], whole: type[BaseModel], chunk: type[BaseModel]
) -> Operation:
    """A completion route's operation: `whole` as JSON, or with `stream` SSE of `chunk`s."""
    reply = Reply(
        f"the whole {whole.__name__}; with `stream`, SSE of `data: {chunk.__name__}` events ending with "
        "`data: [DONE]`",
        whole,
        stream=Events(f"a JSON {chunk.__name__}, an error envelope, or [DONE]", chunk),
        headers={JOB_ID_HEADER: "The id of the job behind each choice, comma-separated in choice order"},
    )
    return Operation(summary, request=request, responses={200: reply}, errors=(400, 404, 413, 429, 500, 503))


async def served_model(state: AppState, requested: str | None) -> ServedModel:
    """The model (or LoRA adapter) a request names, in OpenAI's error terms when there is none."""
    try:
        return await resolve_model(state, requested)
    except ApiError as e:
        raise as_openai_error(e) from e


async def submit_choices(
    request: Request, model: str, jobs: list[JobRequest], prompt_of: list[int], prompt_param: str
) -> Choices:
    """Queues the jobs of a request's choices, owned by its caller."""
    owner = principal_of(request.scope)
    state = app_state(request)
    return await Choices.submit(state, model, jobs, prompt_of, prompt_param=prompt_param, owner=owner)


async def respond(
    request: Request, choices: Choices, form: ResponseFormat, body: GenerationParams
) -> Response:
    """The whole response once every job ended, or (when `body` streams) SSE chunks as they generate.

    A streamed response is held back until every job has started, for at most the SSE keep-alive
    interval, so a job that fails before it starts still gets a proper HTTP error. A client that
    disconnects at any point cancels the jobs, as does the gateway being told to stop (503
    server_shutting_down before the response starts, an error in band once it streams).
    """
    headers = {JOB_ID_HEADER: ",".join(choices.job_ids)}
    hold_s = choices.state.settings.sse_keepalive_s
    events = choices.events(hold_s)
    stopping = choices.state.stopping
    try:
        if body.streaming:
            seen = await unless_stopping(
                stopping, until_disconnect(request, choices.wait_started(events, hold_s))
            )
        else:
            results = await unless_stopping(stopping, until_disconnect(request, choices.results(events)))
    except ClientGone:
        choices.release()
        await events.aclose()
        await choices.cancel()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except GatewayStopping:
        choices.release()
        await events.aclose()
        await choices.cancel()
        raise shutting_down(headers) from None
    except BaseException:
        choices.release()
        await events.aclose()
        raise
    if body.streaming:
        chunks = ChunkStream(choices, form, body.include_usage, body.continuous_usage)
        return JobStreamResponse(chunks, seen, events, hold_s, headers)  # releases the slot when it ends
    choices.release()
    await events.aclose()
    usage = choices.total_usage([result.usage for result in results])
    return JSONResponse(form.complete(results, usage).model_dump(mode="json"), headers=headers)
