"""A request's jobs relayed as OpenAI chunks over SSE, ending with `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol

import anyio
import orjson
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from common.events import entry_token_ids
from common.wire import EventType, Usage
from gateway.errors import envelope
from gateway.openai_api.choices import ChoiceEvent, ChoiceResult, Choices, finish_reason
from gateway.openai_api.protocol import OpenAIFinishReason
from gateway.sse import KEEPALIVE, EventStreamResponse

DONE = b"data: [DONE]\n\n"


class ResponseFormat(Protocol):
    """How one endpoint (chat or text completions) shapes its chunks and its whole response."""

    def opening(self) -> Sequence[BaseModel]: ...

    def text(self, index: int, text: str) -> BaseModel: ...

    def finish(self, index: int, reason: OpenAIFinishReason) -> BaseModel: ...

    def usage(self, usage: Usage) -> BaseModel: ...

    def complete(self, results: list[ChoiceResult], usage: Usage) -> BaseModel: ...


def frame(payload: BaseModel | dict[str, Any]) -> bytes:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


class TextFrames:
    """The frames of a format's text chunks, nearly all of a stream's: each choice's chunk is serialized
    once, around a marker, and a token's text goes where the marker was. The bytes are those of
    `frame(form.text(index, text))`, without building and serializing a chunk model per token."""

    _MARK = "\x00ortfleet-text\x00"

    def __init__(self, form: ResponseFormat) -> None:
        self._form = form
        self._halves: dict[int, tuple[bytes, bytes] | None] = {}

    def __call__(self, index: int, text: str) -> bytes:
        if index not in self._halves:
            marked = frame(self._form.text(index, self._MARK))
            before, mark, after = marked.partition(orjson.dumps(self._MARK))
            self._halves[index] = (before, after) if mark else None
        halves = self._halves[index]
        if halves is None:
            return frame(self._form.text(index, text))
        return halves[0] + orjson.dumps(text) + halves[1]


async def chunks(
    choices: Choices,
    seen: list[ChoiceEvent],
    events: AsyncIterator[list[ChoiceEvent]],
    form: ResponseFormat,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """The opening chunks, then text as the jobs stream it, a finish chunk per choice, usage, [DONE]:
    the chunks of one read of the jobs' streams go out together, in one write.

    A job that fails mid-stream ends the stream with OpenAI's in-stream error
    (`data: {"error": {...}}`, which the SDK raises) after its other jobs are cancelled.
    """
    usages = [Usage() for _ in choices.job_ids]
    text_frame = TextFrames(form)
    opening = b"".join(frame(chunk) for chunk in form.opening())  # goes with the first read, if any
    if not seen:
        yield opening
        opening = b""
    async for read in _chain(seen, events):
        if not read:
            yield KEEPALIVE
            continue
        out = [opening]
        opening = b""
        for event in read:
            if event.kind == EventType.status.value and "prompt_tokens" in event.fields:
                usages[event.index].prompt_tokens = int(event.fields["prompt_tokens"])
            elif event.kind == EventType.token.value:
                text = event.fields.get("text", "")
                usage = usages[event.index]
                usage.completion_tokens += len(entry_token_ids(event.fields))
                if text and continuous_usage:  # vLLM's continuous_usage_stats: the usage so far, every chunk
                    chunk = form.text(event.index, text)
                    out.append(frame(chunk.model_copy(update={"usage": choices.total_usage(usages)})))
                elif text:
                    out.append(text_frame(event.index, text))
            elif event.kind == EventType.done.value:
                usages[event.index] = event.usage()
                out.append(frame(form.finish(event.index, finish_reason(event.fields.get("finish_reason")))))
            elif event.kind == EventType.error.value:
                await choices.cancel()
                error = choices.failure(event)
                out += [frame(envelope(error.status, error.message, error.param, error.code)), DONE]
                yield b"".join(out)
                return
        if body := b"".join(out):
            yield body
    end = frame(form.usage(choices.total_usage(usages))) if include_usage else b""
    yield end + DONE


async def _chain(
    seen: list[ChoiceEvent], events: AsyncIterator[list[ChoiceEvent]]
) -> AsyncIterator[list[ChoiceEvent]]:
    if seen:
        yield seen
    async for later in events:
        yield later


class JobStreamResponse(EventStreamResponse):
    """An SSE response fed by a request's jobs: if it ends before its last chunk (the client went
    away), the jobs are cancelled, so the workers stop within one engine step and free their slots."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        choices: Choices,
        events: AsyncGenerator[list[ChoiceEvent], None],
        headers: dict[str, str],
    ) -> None:
        self._choices = choices
        self._events = events
        super().__init__(content, headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.release()
            with anyio.CancelScope(shield=True):
                if not self.ended:
                    await self._choices.cancel()
                await self._events.aclose()
