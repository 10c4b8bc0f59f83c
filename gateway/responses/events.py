"""A response as OpenAI shows it, and its streaming events, derived from its job's record and stream.

The events are a pure function of the job's stream, so every gateway numbers them the same way and a
reader resumes after any `sequence_number` by replaying the stream and skipping what it has seen.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from common.events import is_failure
from common.records import JobRecord
from common.wire import EventType, FinishReason, JobStatus
from gateway.sse import Entry, json_bytes

_STATUS = {
    JobStatus.queued.value: "queued",
    JobStatus.running.value: "in_progress",
    JobStatus.succeeded.value: "completed",
    JobStatus.failed.value: "failed",
    JobStatus.cancelled.value: "cancelled",
}


def response_id(job_id: str) -> str:
    return "resp_" + job_id.removeprefix("job_")


def job_id_of(response_id: str) -> str:
    return "job_" + response_id.removeprefix("resp_")


def message_id(job_id: str) -> str:
    return "msg_" + job_id.removeprefix("job_")


def _usage(raw: str | None) -> dict[str, Any] | None:
    if not raw:
        return None
    usage = json.loads(raw)
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        },
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def _message(job_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": message_id(job_id),
        "status": status,
        "role": "assistant",
        "content": [_part(text)],
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(
    meta: dict[str, str],
    status: str,
    *,
    text: str | None = None,
    usage: str | None = None,
    error: dict[str, str] | None = None,
    truncated: bool = False,
) -> dict[str, Any]:
    """The response object; `meta` is the response's record (what the request asked for)."""
    job_id = meta["job_id"]
    if status == "completed" and truncated:
        status = "incomplete"
    output = []
    if text is not None:
        item_status = {"completed": "completed", "in_progress": "in_progress"}.get(status, "incomplete")
        output.append(_message(job_id, text, item_status))
    return {
        "id": meta["id"],
        "object": "response",
        "created_at": int(float(meta["created_at"])),
        "status": status,
        "background": meta.get("background") == "1",
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": meta.get("instructions") or None,
        "max_output_tokens": int(meta["max_output_tokens"]) if meta.get("max_output_tokens") else None,
        "model": meta["model"],
        "output": output,
        "parallel_tool_calls": False,
        "temperature": float(meta["temperature"]) if meta.get("temperature") else None,
        "top_p": float(meta["top_p"]) if meta.get("top_p") else None,
        "tool_choice": "none",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "store": meta.get("store", "1") == "1",
        "metadata": json.loads(meta["metadata"]) if meta.get("metadata") else {},
        "usage": _usage(usage),
    }


def view_from_job(meta: dict[str, str], job: JobRecord | None) -> dict[str, Any]:
    """The response as it stands, from its job's record."""
    if job is None:
        return response_object(meta, "failed", error={"code": "server_error", "message": "the job is gone"})
    status = _STATUS[job.status.value]
    text = job.output
    error = None
    if status == "failed":
        code = job.error_code.value if job.error_code else "server_error"
        error = {"code": code, "message": job.error or "failed"}
    return response_object(
        meta,
        status,
        text=text if text is not None or status == "completed" else None,
        usage=job.usage.model_dump_json() if job.usage else None,
        error=error,
        truncated=job.finish_reason is FinishReason.length,
    )


@dataclass
class EventNumbering:
    """Turns the job's stream entries into Responses events, numbered from 0 by `sequence_number`."""

    meta: dict[str, str]
    sequence: int = 0
    started: bool = False
    text: list[str] = field(default_factory=list)

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
        job_id = self.meta["job_id"]
        yield self._event("response.in_progress", response=response_object(self.meta, "in_progress"))
        item = {**_message(job_id, "", "in_progress"), "content": []}
        yield self._event("response.output_item.added", output_index=0, item=item)
        yield self._event(
            "response.content_part.added",
            item_id=message_id(job_id),
            output_index=0,
            content_index=0,
            part=_part(""),
        )

    def entry(self, fields: dict[str, str]) -> Iterator[dict[str, Any]]:
        kind = fields.get("type")
        if kind == EventType.status.value:
            if fields.get("status") != JobStatus.queued.value:
                yield from self._start()
            return
        yield from self._start()
        job_id = self.meta["job_id"]
        item_id = message_id(job_id)
        if kind == EventType.token.value:
            delta = fields.get("text", "")
            if delta:
                self.text.append(delta)
                yield self._event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=0,
                    content_index=0,
                    delta=delta,
                    logprobs=[],
                )
            return
        text = "".join(self.text)
        if is_failure(fields):
            error = {"code": fields.get("code") or "server_error", "message": fields.get("message", "failed")}
            yield self._event(
                "response.failed", response=response_object(self.meta, "failed", text=text, error=error)
            )
            return
        if kind != EventType.done.value:
            return
        status = _STATUS.get(fields.get("status", ""), "completed")
        truncated = fields.get("finish_reason") == "length"
        item_status = "completed" if status == "completed" and not truncated else "incomplete"
        yield self._event(
            "response.output_text.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            text=text,
            logprobs=[],
        )
        yield self._event(
            "response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=_part(text)
        )
        yield self._event(
            "response.output_item.done", output_index=0, item=_message(job_id, text, item_status)
        )
        final = response_object(self.meta, status, text=text, usage=fields.get("usage"), truncated=truncated)
        name = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            final["status"], "response.incomplete"
        )
        yield self._event(name, response=final)


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
            b"event: %b\ndata: %b\n\n" % (event["type"].encode(), json_bytes(event))
            for event in events
            if event["sequence_number"] > self._after
        )
