"""OpenAI's Responses request (text only) and its translation into an ortfleet job request."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.error_codes import ErrorCode
from common.wire import ChatMessage, JobRequest
from gateway.errors import ApiError, validation_error
from gateway.metadata import Metadata

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}

_VERBOSE = (None, "medium")  # text.verbosity values that change nothing: the model's own length


class ResponseRequest(BaseModel):
    """Body of `POST /v1/responses`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name; optional when one model is served.")
    input: str | list[dict[str, Any]] = Field(..., description="A string, or a list of text messages.")
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Default 1; 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling bound; default 1.")
    stream: bool | None = Field(None, description="Send the response's events as they happen (SSE).")
    background: bool | None = Field(
        None, description="Answer at once; the response runs on, to be retrieved, streamed or cancelled."
    )
    store: bool | None = Field(None, description="Keep the response for retrieval (default true).")
    metadata: Metadata | None = Field(
        None, description="Up to 16 string pairs; keys up to 64 characters, values up to 512."
    )
    # OpenAI's parameters ortfleet cannot honour: accepted only unset (or at their neutral values).
    tools: Any = None
    tool_choice: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    # OpenAI's fields for its own models and platform: accepted at the values that change nothing here.
    service_tier: Any = None
    truncation: Any = None
    context_management: Any = None
    moderation: Any = None
    include: Any = None
    text: Any = None

    @property
    def stored(self) -> bool:
        return self.store is not False

    def unsupported_parameters(self) -> list[str]:
        neutral = {
            "tools": self.tools in (None, []),
            "tool_choice": self.tool_choice in (None, "none", "auto"),
            "previous_response_id": self.previous_response_id is None,
            "conversation": self.conversation is None,
            "prompt": self.prompt is None,
            "reasoning": self.reasoning is None,
            "service_tier": self.service_tier in (None, "auto", "default"),  # no other tier to run on
            "truncation": self.truncation in (None, "disabled"),  # a prompt past the context is a 400
            "context_management": self.context_management is None,  # no compaction
            "moderation": self.moderation is None,  # no moderation
            "text.verbosity": not isinstance(self.text, dict) or self.text.get("verbosity") in _VERBOSE,
            "include": self.include in (None, []),
            "text": self.text is None or self.text in ({"format": {"type": "text"}}, {}),
        }
        return [name for name, ok in neutral.items() if not ok]


def check_supported(body: ResponseRequest) -> None:
    names = body.unsupported_parameters()
    if names:
        raise ApiError(
            400,
            f"{', '.join(names)}: not supported by ortfleet (text only); leave "
            f"{'it' if len(names) == 1 else 'them'} unset",
            param=names[0],
            code=ErrorCode.unsupported_parameter,
        )
    if body.background and not body.stored:
        raise ApiError(400, "store: a background response must be stored (store=true)", param="store")


def input_messages(body: ResponseRequest) -> list[ChatMessage]:
    """The job's chat messages: the instructions as a system message, then the input."""
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
        return messages
    if not body.input:
        raise ApiError(400, "input: must not be empty", param="input")
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind != "message":
            raise ApiError(
                400,
                f"input.{i}: items of type {kind!r} are not supported by ortfleet (text messages only)",
                param=f"input.{i}",
                code=ErrorCode.unsupported_value,
            )
        role = _ROLES.get(str(item.get("role")))
        if role is None:
            raise ApiError(
                400,
                f"input.{i}.role: {item.get('role')!r} is not one of {sorted(_ROLES)}",
                param=f"input.{i}.role",
            )
        messages.append(
            ChatMessage.model_validate({"role": role, "content": _content(item.get("content"), i)})
        )
    return messages


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(
            400, f"input.{i}.content: a string or a list of text parts", param=f"input.{i}.content"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(text, str):
            what = {"input_image": "images", "input_file": "files", "input_audio": "audio"}.get(
                str(kind), repr(kind)
            )
            raise ApiError(
                400,
                f"input.{i}.content.{j}: {what} are not supported by ortfleet (text parts only)",
                param=f"input.{i}.content.{j}",
                code=ErrorCode.unsupported_value,
            )
        texts.append(text)
    return "\n".join(texts)


_JOB_FIELDS = {"max_tokens": "max_output_tokens"}  # the job request's names of the Responses fields


def in_responses_terms(error: ApiError) -> ApiError:
    """An error about the response's job, naming the field as the Responses request calls it."""
    name = _JOB_FIELDS.get(error.param or "")
    if name is None:
        return error
    message = error.message.replace(f"{error.param}:", f"{name}:", 1)
    return ApiError(error.status, message, param=name, code=error.code, headers=error.headers)


def response_job(body: ResponseRequest, model: str) -> JobRequest:
    fields: dict[str, Any] = {
        "model": model,
        "messages": input_messages(body),
        "max_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": body.top_p,
    }
    try:
        return JobRequest.model_validate({key: value for key, value in fields.items() if value is not None})
    except ValidationError as e:
        raise in_responses_terms(validation_error(e, 400)) from e
