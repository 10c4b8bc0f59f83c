"""A request's jobs relayed as OpenAI chunks over SSE, ending with `data: [DONE]`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import anyio
import orjson
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from common.error_codes import ErrorCode
from common.events import closed_early_of, entry_token_ids
from common.wire import EventType, Usage
from gateway.errors import envelope
from gateway.openai_api.choices import ChoiceEvent, ChoiceEvents, ChoiceResult, Choices, finish_reason
from gateway.openai_api.logprobs import TextOffsets
from gateway.openai_api.protocol import OpenAIFinishReason
from gateway.stopping import SHUTTING_DOWN, Stopping
from gateway.streaming.departure import disconnect_watch
from gateway.streaming.direct import DirectBody, PushedWrites, direct_body, write_direct
from gateway.streaming.sse import KEEPALIVE, EventStreamResponse, frame, json_bytes

DONE = b"data: [DONE]\n\n"


class ResponseFormat(Protocol):
    """How one endpoint (chat or text completions) shapes its chunks and its whole response."""

    def opening(self) -> Sequence[BaseModel]: ...

    def text(self, index: int, text: str) -> BaseModel: ...

    def tokens(
        self, index: int, text: str, logprobs: list[dict[str, Any]], offsets: TextOffsets
    ) -> BaseModel:
        """A text chunk with its tokens' log-probabilities; `offsets`: the choice's, so far."""
        ...

    def prompt(self, index: int, logprobs: list[dict[str, Any]], offsets: TextOffsets) -> BaseModel | None:
        """The chunk of a choice's echoed prompt with its tokens' log-probabilities, when it echoes."""
        ...

    def finish(
        self, index: int, reason: OpenAIFinishReason, closed_early: bool | None = None
    ) -> BaseModel: ...

    def read_text(
        self, index: int, text: str, logprobs: list[dict[str, Any]] | None
    ) -> Sequence[BaseModel] | None:
        """The chunks for a piece of text when the format reads it (tool calls); None: send it as text."""
        ...

    def usage(self, usage: Usage) -> BaseModel: ...

    def complete(self, results: list[ChoiceResult], usage: Usage) -> BaseModel: ...


def chunk_frame(payload: BaseModel | dict[str, Any]) -> bytes:
    """A chunk (or an in-stream error) as an event of OpenAI's stream: a data line alone."""
    if isinstance(payload, BaseModel):
        return frame(payload.model_dump_json().encode())
    return frame(json_bytes(payload))


class TextFrames:
    """The frames of a format's text chunks, nearly all of a stream's: each choice's chunk is serialized
    once, around a marker, and a token's text goes where the marker was. The bytes are those of
    `chunk_frame(form.text(index, text))`, without building and serializing a chunk model per token."""

    _MARK = "\x00ortfleet-text\x00"

    def __init__(self, form: ResponseFormat) -> None:
        self._form = form
        self._halves: dict[int, tuple[bytes, bytes] | None] = {}

    def __call__(self, index: int, text: str) -> bytes:
        if index not in self._halves:
            marked = chunk_frame(self._form.text(index, self._MARK))
            before, mark, after = marked.partition(orjson.dumps(self._MARK))
            self._halves[index] = (before, after) if mark else None
        halves = self._halves[index]
        if halves is None:
            return chunk_frame(self._form.text(index, text))
        return halves[0] + orjson.dumps(text) + halves[1]


class ChunkStream:
    """What a request's streamed response says, read by read: the opening chunks (with the first read),
    text as the jobs stream it, a finish chunk per choice, the usage, [DONE]. A job that fails
    mid-stream ends it with OpenAI's in-stream error (`data: {"error": {...}}`, which the SDK raises)
    once the other jobs are cancelled: a read stops at the error, which `failure` then holds."""

    def __init__(
        self, choices: Choices, form: ResponseFormat, include_usage: bool, continuous_usage: bool = False
    ) -> None:
        self.choices = choices
        self._form = form
        self._include_usage = include_usage
        self._continuous_usage = continuous_usage  # vLLM's continuous_usage_stats: usage in every chunk
        self._usages = [Usage() for _ in choices.job_ids]
        self._offsets = [TextOffsets() for _ in choices.job_ids]  # for completions' text_offset
        self._text_frame = TextFrames(form)
        self._opening = b"".join(chunk_frame(chunk) for chunk in form.opening())
        self.failure: ChoiceEvent | None = None

    def opening(self) -> bytes:
        """The opening chunks, unless they went out already."""
        opening, self._opening = self._opening, b""
        return opening

    def read(self, read: list[ChoiceEvent]) -> bytes:
        """The chunks of one read of the jobs' streams (after the opening, if it did not go out yet)."""
        form, usages = self._form, self._usages
        out = [self.opening()]
        for event in read:
            if event.kind == EventType.status.value and "prompt_tokens" in event.fields:
                usages[event.index].prompt_tokens = int(event.fields["prompt_tokens"])
            elif (prompt := event.prompt_logprobs) is not None:
                if (echoed := form.prompt(event.index, prompt, self._offsets[event.index])) is not None:
                    out.append(chunk_frame(echoed))
            elif event.kind == EventType.token.value:
                text = event.fields.get("text", "")
                usages[event.index].completion_tokens += len(entry_token_ids(event.fields))
                logprobs = event.logprobs
                rewritten = form.read_text(event.index, text, logprobs)
                if rewritten is not None:
                    out.extend(chunk_frame(chunk) for chunk in rewritten)
                elif logprobs is not None:
                    chunk = form.tokens(event.index, text, logprobs, self._offsets[event.index])
                    if self._continuous_usage:
                        chunk = chunk.model_copy(update={"usage": self.choices.total_usage(usages)})
                    out.append(chunk_frame(chunk))
                elif text and self._continuous_usage:
                    chunk = form.text(event.index, text)
                    out.append(
                        chunk_frame(chunk.model_copy(update={"usage": self.choices.total_usage(usages)}))
                    )
                elif text:
                    out.append(self._text_frame(event.index, text))
            elif event.failed:
                self.failure = event
                break
            elif event.kind == EventType.done.value:
                usages[event.index] = event.usage()
                reason = finish_reason(event.fields.get("finish_reason"))
                closed = closed_early_of(event.fields)
                out.append(chunk_frame(form.finish(event.index, reason, closed)))
        return b"".join(out)

    def failed(self) -> bytes:
        """The in-stream error for `failure`, and [DONE]."""
        assert self.failure is not None
        error = self.choices.failure(self.failure)
        return chunk_frame(envelope(error.status, error.message, error.param, error.code)) + DONE

    def shutting_down(self) -> bytes:
        """The in-stream error of a gateway told to stop (a server_error, as OpenAI's own in-stream
        errors are), and [DONE]: the client learns its text is cut, and may ask again elsewhere."""
        error = envelope(500, SHUTTING_DOWN, code=ErrorCode.server_shutting_down)
        return chunk_frame(error) + DONE

    def end(self) -> bytes:
        """The usage chunk (if asked for) and [DONE], once every job ended."""
        if not self._include_usage:
            return DONE
        return chunk_frame(self._form.usage(self.choices.total_usage(self._usages))) + DONE


async def chunks(
    stream: ChunkStream,
    seen: list[ChoiceEvent],
    events: AsyncIterator[list[ChoiceEvent]],
    stopping: Stopping | None = None,
) -> AsyncIterator[bytes]:
    """The stream's chunks as a generator (behind a server without DIRECT_BODY_EXTENSION): `seen`, then
    each read of `events` in one write, a keep-alive for an empty read. Once `stopping` is set (the
    gateway was told to stop) the next read (a keep-alive's, at the latest) ends it with the in-stream
    error instead."""
    if not seen:
        yield stream.opening()
    async for read in _chain(seen, events):
        if stopping is not None and stopping.is_set():
            await stream.choices.cancel()
            yield stream.shutting_down()
            return
        if not read:
            yield KEEPALIVE
            continue
        body = stream.read(read)
        if stream.failure is not None:
            await stream.choices.cancel()
            yield body + stream.failed()
            return
        if body:
            yield body
    yield stream.end()


async def _chain(
    seen: list[ChoiceEvent], events: AsyncIterator[list[ChoiceEvent]]
) -> AsyncIterator[list[ChoiceEvent]]:
    if seen:
        yield seen
    async for later in events:
        yield later


class PushedChunks:
    """The stream's chunks written to the connection from the relay's callback as each read of the jobs'
    streams is handed over: the response's task wakes only for a keep-alive (and the purge check that
    goes with it), a client that reads too slowly, a failed job, the gateway told to stop, and the
    end."""

    def __init__(
        self, body: DirectBody, stream: ChunkStream, events: ChoiceEvents, keepalive_s: float
    ) -> None:
        self._stream = stream
        self._events = events
        pauses = stream.choices.state.metrics.sse_client_pauses
        self._writes = PushedWrites(body, events, keepalive_s, pauses.inc)
        self._held = b""  # a failed read's chunks: they go out with the error, once the jobs are cancelled
        self._stopping = False  # the gateway was told to stop: the stream ends with server_shutting_down

    async def run(self, seen: list[ChoiceEvent]) -> None:
        """Writes the whole stream, up to its [DONE]."""
        unlisten = self._stream.choices.state.stopping.listen(self._stop)
        try:
            await self._run(seen)
        finally:
            unlisten()

    async def _run(self, seen: list[ChoiceEvent]) -> None:
        writes = self._writes
        if seen:
            self._handle(seen)
        else:
            writes.write(self._stream.opening())
        self._events.push_to(self._arrived)
        while True:
            if self._stream.failure is not None:
                await self._stream.choices.cancel()
                writes.write(self._held + self._stream.failed())
                return
            if self._events.over:
                writes.write(self._stream.end())
                return
            if self._stopping:
                writes.write(self._stream.shutting_down())
                await self._stream.choices.cancel()
                return
            if not await writes.idle():
                continue
            if purged := await self._events.purged():
                self._handle(purged)
            else:
                writes.write(KEEPALIVE)

    def _stop(self) -> None:
        self._stopping = True
        self._writes.wake()

    def _arrived(self) -> None:
        read = self._events.take()
        if read and self._stream.failure is None and not self._stopping:
            self._handle(read)
        if self._events.over:
            self._writes.wake()

    def _handle(self, read: list[ChoiceEvent]) -> None:
        body = self._stream.read(read)
        if self._stream.failure is not None:
            self._held = body
            self._writes.wake()
        else:
            self._writes.write(body)


class JobStreamResponse(EventStreamResponse):
    """An SSE response fed by a request's jobs: if it ends before its last chunk (the client went
    away), the jobs are cancelled, so the workers stop within one engine step and free their slots.

    Behind the gateway's own protocol (DIRECT_BODY_EXTENSION, DISCONNECT_EXTENSION) the chunks are
    written from the relay's callback (PushedChunks); behind any other server, by a generator."""

    def __init__(
        self,
        stream: ChunkStream,
        seen: list[ChoiceEvent],
        events: ChoiceEvents,
        keepalive_s: float,
        headers: dict[str, str],
    ) -> None:
        self._stream = stream
        self._seen = seen
        self._events = events
        self._keepalive_s = keepalive_s
        super().__init__(chunks(stream, seen, events, stream.choices.state.stopping), headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, watch = direct_body(scope), disconnect_watch(scope)
        try:
            if body is None or watch is None:
                await super().__call__(scope, receive, send)
                return

            async def write() -> None:
                await PushedChunks(body, self._stream, self._events, self._keepalive_s).run(self._seen)

            self.ended = await write_direct(send, self.raw_headers, watch, write)
        finally:
            choices = self._stream.choices
            choices.release()
            with anyio.CancelScope(shield=True):
                if not self.ended:
                    await choices.cancel()
                await self._events.aclose()
