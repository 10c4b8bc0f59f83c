"""A response as OpenAI shows it, derived from its record (what the request asked for) and its job's
generated text: an assistant `message`, or, when the request allowed tool calls and the text is calls,
one `function_call` item per call. Item and call ids follow from the response's id, so every gateway
and every reading of the job names them alike."""

from __future__ import annotations

import json
from typing import Any

from common.jobs.record import JobRecord
from common.wire import FinishReason, JobStatus
from gateway.openai_api.tool_calls import CallReader, ReadCall

STATUS = {
    JobStatus.queued.value: "queued",
    JobStatus.running.value: "in_progress",
    JobStatus.succeeded.value: "completed",
    JobStatus.failed.value: "failed",
    JobStatus.cancelled.value: "cancelled",
}


def _hex(job_id: str) -> str:
    return job_id.removeprefix("job_")


def response_id(job_id: str) -> str:
    return "resp_" + _hex(job_id)


def job_id_of(response_id: str) -> str:
    return "job_" + response_id.removeprefix("resp_")


def message_id(job_id: str) -> str:
    return "msg_" + _hex(job_id)


def call_item_id(job_id: str, index: int) -> str:
    return f"fc_{_hex(job_id)}_{index}"


def call_reader(meta: dict[str, str]) -> CallReader | None:
    """A reader of the job's text as calls, when the request allowed calls."""
    if meta.get("calls") != "1":
        return None
    hex_id = _hex(meta["job_id"])
    return CallReader(lambda index: f"call_{hex_id}_{index}")


# ortfleet's error codes a failed response reports as one of OpenAI's (its ResponseErrorCode enum): a
# request the model cannot take is OpenAI's invalid_prompt; anything else is server_error.
_PROMPT_ERRORS = {
    "context_length_exceeded",
    "invalid_prompt",
    "invalid_response_format",
    "unsupported_parameter",
    "unsupported_value",
}


def response_error(code: str | None, message: str) -> dict[str, str]:
    """A failed response's `error`, its code one of OpenAI's; ortfleet's own code leads the message."""
    if not code or code == "server_error":
        return {"code": "server_error", "message": message}
    shown = "invalid_prompt" if code in _PROMPT_ERRORS else "server_error"
    return {"code": shown, "message": message if code == shown else f"{code}: {message}"}


def _usage(raw: str | None) -> dict[str, Any] | None:
    if not raw:
        return None
    usage = json.loads(raw)
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message(
    job_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": message_id(job_id),
        "status": status,
        "role": "assistant",
        "content": [part(text, logprobs)],
    }


def call_item(job_id: str, index: int, call: ReadCall, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": call_item_id(job_id, index),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def delta_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logprobs as the text events carry them: without `bytes`."""
    return [
        {
            "token": entry["token"],
            "logprob": entry["logprob"],
            "top_logprobs": [
                {"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]
            ],
        }
        for entry in entries
    ]


def output_items(
    meta: dict[str, str], text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The response's output for the job's text so far: a message, or its calls (a call cut short is
    `incomplete`, or `in_progress` while the response runs)."""
    job_id = meta["job_id"]
    reader = call_reader(meta)
    if reader is not None:
        reader.feed(text)
        if reader.made_calls:
            unfinished = "in_progress" if status == "in_progress" else "incomplete"
            return [
                call_item(job_id, i, call, "completed" if call.complete else unfinished)
                for i, call in enumerate(reader.calls)
            ]
    item_status = {"completed": "completed", "in_progress": "in_progress"}.get(status, "incomplete")
    return [message(job_id, text, item_status, logprobs)]


def _json_field(meta: dict[str, str], name: str, default: Any) -> Any:
    raw = meta.get(name)
    return json.loads(raw) if raw else default


def response_object(
    meta: dict[str, str],
    status: str,
    *,
    text: str | None = None,
    usage: str | None = None,
    error: dict[str, str] | None = None,
    truncated: bool = False,
    logprobs: list[dict[str, Any]] | None = None,
    closed_early: bool | None = None,
) -> dict[str, Any]:
    """The response object; `text` is the job's generated text (None: no output yet). `closed_early`
    (ortfleet's field, shown when set): true, the engine ended the structured output early, within
    max_output_tokens; false, max_output_tokens cut it and closing was off for its format."""
    if status == "completed" and truncated:
        status = "incomplete"
    output = [] if text is None else output_items(meta, text, status, logprobs)
    top_logprobs = meta.get("top_logprobs")
    shown: dict[str, Any] = {
        "id": meta["id"],
        "object": "response",
        "created_at": int(float(meta["created_at"])),
        "status": status,
        "background": meta.get("background") == "1",
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": meta.get("instructions") or None,
        "max_output_tokens": int(meta["max_output_tokens"]) if meta.get("max_output_tokens") else None,
        "model": meta.get("adapter") or meta["model"],
        "output": output,
        "parallel_tool_calls": meta.get("parallel_tool_calls", "1") == "1",
        "previous_response_id": meta.get("previous_response_id") or None,
        "temperature": float(meta["temperature"]) if meta.get("temperature") else None,
        "top_p": float(meta["top_p"]) if meta.get("top_p") else None,
        "top_logprobs": int(top_logprobs) if top_logprobs else None,
        "tool_choice": _json_field(meta, "tool_choice", "auto"),
        "tools": _json_field(meta, "tools", []),
        "text": {"format": _json_field(meta, "text_format", {"type": "text"})},
        "store": meta.get("store", "1") == "1",
        "metadata": _json_field(meta, "metadata", {}),
    }
    if closed_early is not None:
        shown["closed_early"] = closed_early
    counted = _usage(usage)
    if counted is not None:  # none until the response ends
        shown["usage"] = counted
    return shown


def view_from_job(
    meta: dict[str, str], job: JobRecord | None, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The response as it stands, from its job's record (and the logprobs read from its stream)."""
    if job is None:
        return response_object(meta, "failed", error=response_error(None, "the job is gone"))
    status = STATUS[job.status.value]
    text = job.output
    error = None
    if status == "failed":
        error = response_error(job.error_code.value if job.error_code else None, job.error or "failed")
    if text is None and status in ("completed", "cancelled"):
        text = ""
    return response_object(
        meta,
        status,
        text=text,
        usage=job.usage.model_dump_json() if job.usage else None,
        error=error,
        truncated=job.finish_reason is FinishReason.length,
        logprobs=logprobs,
        closed_early=job.closed_early,
    )
