"""A response's streaming events, derived from its job's stream.

The events are a pure function of the job's stream, so every gateway numbers them the same way and a
reader resumes after any `sequence_number` by replaying the stream and skipping what it has seen.
Text goes out as an assistant message's `output_text` deltas; when the request allowed tool calls and
the model writes calls, each call is a `function_call` item whose arguments stream as they grow.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from common.events import closed_early_of, entry_logprobs, is_failure
from common.wire import EventType, JobStatus
from gateway.openai_api.tool_calls import CallReader
from gateway.responses.output import (
    STATUS,
    call_item,
    call_item_id,
    call_reader,
    delta_logprobs,
    message,
    message_id,
    part,
    response_error,
    response_object,
)
from gateway.streaming.ids import Entry
from gateway.streaming.sse import frame, json_bytes

__all__ = ["EventFrames", "EventNumbering", "response_object"]


@dataclass
class EventNumbering:
    """Turns the job's stream entries into Responses events, numbered from 0 by `sequence_number`."""

    meta: dict[str, str]
    sequence: int = 0
    started: bool = False
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    _reader: CallReader | None = None
    _message_open: bool = False
    _calls_done: int = 0  # the calls whose done events went out

    def __post_init__(self) -> None:
        self._reader = call_reader(self.meta)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> Iterator[dict[str, Any]]:
        status = "queued" if self.meta.get("background") == "1" else "in_progress"
        yield self._event("response.created", response=response_object(self.meta, status))

    def _start(self) -> Iterator[dict[str, Any]]:
        if self.started:
            return
        self.started = True
        yield self._event("response.in_progress", response=response_object(self.meta, "in_progress"))
        if self._reader is None:  # text only: the message opens at once
            yield from self._open_message()

    def _open_message(self) -> Iterator[dict[str, Any]]:
        if self._message_open:
            return
        self._message_open = True
        job_id = self.meta["job_id"]
        item = {**message(job_id, "", "in_progress"), "content": []}
        yield self._event("response.output_item.added", output_index=0, item=item)
        yield self._event(
            "response.content_part.added",
            item_id=message_id(job_id),
            output_index=0,
            content_index=0,
            part=part(""),
        )

    def _text_delta(self, delta: str, logprobs: list[dict[str, Any]] | None) -> Iterator[dict[str, Any]]:
        yield from self._open_message()
        if logprobs:
            self.logprobs.extend(logprobs)
        yield self._event(
            "response.output_text.delta",
            item_id=message_id(self.meta["job_id"]),
            output_index=0,
            content_index=0,
            delta=delta,
            logprobs=delta_logprobs(logprobs or []),
        )

    def _token(self, delta: str, logprobs: list[dict[str, Any]] | None) -> Iterator[dict[str, Any]]:
        reader = self._reader
        if reader is None:
            yield from self._text_delta(delta, logprobs)
            return
        plain, pieces = reader.feed(delta)
        if plain or (logprobs and self._message_open):
            yield from self._text_delta(plain, logprobs)
        job_id = self.meta["job_id"]
        for piece in pieces:
            if piece.name is not None:
                item = call_item(job_id, piece.index, reader.calls[piece.index], "in_progress")
                yield self._event(
                    "response.output_item.added", output_index=piece.index, item={**item, "arguments": ""}
                )
            if piece.arguments:
                yield self._event(
                    "response.function_call_arguments.delta",
                    item_id=call_item_id(job_id, piece.index),
                    output_index=piece.index,
                    delta=piece.arguments,
                )
        while self._calls_done < len(reader.calls) and reader.calls[self._calls_done].complete:
            index, call = self._calls_done, reader.calls[self._calls_done]
            self._calls_done += 1
            yield self._event(
                "response.function_call_arguments.done",
                item_id=call_item_id(job_id, index),
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            )
            yield self._event(
                "response.output_item.done",
                output_index=index,
                item=call_item(job_id, index, call, "completed"),
            )

    def entry(self, fields: dict[str, str]) -> Iterator[dict[str, Any]]:
        kind = fields.get("type")
        if kind == EventType.status.value:
            if fields.get("status") != JobStatus.queued.value:
                yield from self._start()
            return
        yield from self._start()
        if kind == EventType.token.value:
            delta, logprobs = fields.get("text", ""), entry_logprobs(fields)
            if delta or logprobs:
                self.text.append(delta)
                yield from self._token(delta, logprobs)
            return
        text = "".join(self.text)
        if is_failure(fields):
            error = response_error(fields.get("code"), fields.get("message", "failed"))
            failed = response_object(self.meta, "failed", text=text, error=error, logprobs=self.logprobs)
            yield self._event("response.failed", response=failed)
            return
        if kind != EventType.done.value:
            return
        status = STATUS.get(fields.get("status", ""), "completed")
        truncated = fields.get("finish_reason") == "length"
        if self._reader is not None and self._reader.made_calls:
            yield from self._unfinished_calls(self._reader)
        else:
            yield from self._close_message(text, status, truncated)
        final = response_object(
            self.meta,
            status,
            text=text,
            usage=fields.get("usage"),
            truncated=truncated,
            logprobs=self.logprobs,
            closed_early=closed_early_of(fields),
        )
        name = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            final["status"], "response.incomplete"
        )
        yield self._event(name, response=final)

    def _close_message(self, text: str, status: str, truncated: bool) -> Iterator[dict[str, Any]]:
        yield from self._open_message()
        job_id = self.meta["job_id"]
        item_id = message_id(job_id)
        item_status = "completed" if status == "completed" and not truncated else "incomplete"
        logprobs = self.logprobs
        yield self._event(
            "response.output_text.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            text=text,
            logprobs=delta_logprobs(logprobs),
        )
        yield self._event(
            "response.content_part.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            part=part(text, logprobs),
        )
        yield self._event(
            "response.output_item.done", output_index=0, item=message(job_id, text, item_status, logprobs)
        )

    def _unfinished_calls(self, reader: CallReader) -> Iterator[dict[str, Any]]:
        """A call cut short (the token limit, a cancel) ends as an `incomplete` item."""
        job_id = self.meta["job_id"]
        for index in range(self._calls_done, len(reader.calls)):
            item = call_item(job_id, index, reader.calls[index], "incomplete")
            yield self._event("response.output_item.done", output_index=index, item=item)
        self._calls_done = len(reader.calls)


class EventFrames:
    """A response's events as Server-Sent Events, numbered from its job's stream as it is read: the
    opening, then what each read's entries bring (a `Render` for `JobEventsResponse`). The events at or
    before `starting_after` are left out: a reader that resumes has them."""

    def __init__(self, meta: dict[str, str], starting_after: int = -1) -> None:
        self._numbering = EventNumbering(meta)
        self._after = starting_after

    def opening(self) -> bytes:
        return self._frames(self._numbering.opening())

    def __call__(self, entries: list[Entry]) -> bytes:
        return self._frames(event for _id, fields in entries for event in self._numbering.entry(fields))

    def _frames(self, events: Iterable[dict[str, Any]]) -> bytes:
        return b"".join(
            frame(json_bytes(event), event["type"])
            for event in events
            if event["sequence_number"] > self._after
        )
