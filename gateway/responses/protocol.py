"""OpenAI's Responses request and its translation into an ortfleet job request."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictBool, ValidationError

from common.error_codes import ErrorCode
from common.guidance import ResponseFormat
from common.wire import CACHE_SALT, MAX_TOP_LOGPROBS, ChatMessage, JobRequest
from gateway.errors import ApiError, validation_error
from gateway.metadata import Metadata
from gateway.openai_api.params import reject_unsupported
from gateway.openai_api.protocol import OpenAIRequest, ServiceTier, Unset, neutral
from gateway.openai_api.structured import text_format
from gateway.openai_api.tools import TEXT_AFTER_TOOLS, ToolPlan, flat_tool_plan

# OpenAI's `include` values: only the logprobs change an answer of ortfleet's, which has none of the
# items the others add to (searches, images, code interpreter outputs, reasoning).
INCLUDABLE = (
    "message.output_text.logprobs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
)
LOGPROBS = INCLUDABLE[0]

_VERBOSE = (None, "medium")  # text.verbosity values that change nothing: the model's own length


class ResponseRequest(OpenAIRequest):
    """Body of `POST /v1/responses`."""

    model: str | None = Field(None, description="Served model name; optional when one model is served.")
    input: str | list[Any] = Field(
        ..., description="A string, or a list of items: messages, function_call and function_call_output."
    )
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Default 1; 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling bound; default 1.")
    stream: StrictBool | None = Field(None, description="Send the response's events as they happen (SSE).")
    background: StrictBool | None = Field(
        None, description="Answer at once; the response runs on, to be retrieved, streamed or cancelled."
    )
    store: StrictBool | None = Field(None, description="Keep the response for retrieval (default true).")
    metadata: Metadata | None = Field(
        None, description="Up to 16 string pairs; keys up to 64 characters, values up to 512."
    )
    previous_response_id: str | None = Field(
        None, description="A stored response this one continues: its input and output come before the input."
    )
    tools: Any = Field(
        None, description="Function tools (`type` `function`, `name`, `parameters`, `strict`)."
    )
    tool_choice: Any = Field(
        None, description="`none`, `auto` (default), `required` or {type: function, name}."
    )
    parallel_tool_calls: StrictBool | None = Field(
        None, description="Whether the answer may hold several calls."
    )
    text: Any = Field(
        None, description="`format`: `text`, `json_object` or `json_schema` (name, schema, strict)."
    )
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Logprobs of the likeliest tokens at each step (0 to 20).",
    )
    include: list[str] | None = Field(None, description="`message.output_text.logprobs` gives logprobs.")
    cache_salt: str | None = Field(None, description=CACHE_SALT)
    close_early: StrictBool | None = Field(
        None,
        description="ortfleet's extension, for structured output: true (default) ends the document early "
        "where max_tokens would cut it (the response says `closed_early`); false returns the cut text.",
    )
    # OpenAI's parameters ortfleet cannot honour: accepted only unset.
    conversation: Unset = None
    prompt: Unset = None
    reasoning: Unset = None
    # OpenAI's fields for its own models and platform: accepted at the values that change nothing here.
    service_tier: ServiceTier = None
    truncation: Annotated[Any, neutral("disabled")] = None  # a prompt past the context is a 400
    context_management: Unset = None  # no compaction
    moderation: Unset = None  # no moderation

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def logprobs(self) -> bool:
        """Logprobs were asked for: `include` names them, or `top_logprobs` is set."""
        return LOGPROBS in (self.include or []) or self.top_logprobs is not None

    def unsupported_parameters(self) -> list[str]:
        verbose = not isinstance(self.text, dict) or self.text.get("verbosity") in _VERBOSE
        return [*super().unsupported_parameters(), *([] if verbose else ["text.verbosity"])]


def check_supported(body: ResponseRequest) -> None:
    reject_unsupported(body)
    if body.background and not body.stored:
        raise ApiError(400, "store: a background response must be stored (store=true)", param="store")
    for i, value in enumerate(body.include or []):
        if value not in INCLUDABLE:
            raise ApiError(
                400,
                f"include.{i}: {value!r} is not one of {', '.join(INCLUDABLE)}",
                param=f"include.{i}",
                code=ErrorCode.unsupported_value,
            )


def tool_plan(body: ResponseRequest) -> ToolPlan | None:
    return flat_tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)


def output_format(body: ResponseRequest, plan: ToolPlan | None, tool_turns: bool) -> ResponseFormat | None:
    """The job's grammar: the tools' calls, or `text.format` (not both); text that does not begin as a
    call would when the conversation holds calls (`tool_turns`) and none may follow."""
    requested = text_format(body.text)
    if plan is None or not plan.calls_allowed:
        return TEXT_AFTER_TOOLS if requested is None and tool_turns else requested
    if requested is not None:
        raise ApiError(400, "text.format: not with tool calls; leave it unset or text", param="text.format")
    return plan.response_format()


def echoed_format(body: ResponseRequest) -> dict[str, Any]:
    """`text.format` as the response shows it."""
    requested = text_format(body.text)
    if requested is None:
        return {"type": "text"}
    if requested.json_schema is None:
        return {"type": requested.type}
    schema = requested.json_schema
    shown = {"type": "json_schema", "name": schema.name, "schema": schema.schema_, "strict": schema.strict}
    if schema.description is not None:
        shown["description"] = schema.description
    return shown


def echoed_tools(plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The function tools as the response shows them."""
    if plan is None:
        return []
    return [
        {
            "type": "function",
            "name": f.name,
            "description": f.description,
            "parameters": f.parameters,
            "strict": f.strict,
        }
        for f in plan.functions
    ]


_JOB_FIELDS = {  # the job request's names of the Responses fields
    "max_tokens": "max_output_tokens",
    "logprobs": "top_logprobs",
    "response_format": "text.format",
}


def in_responses_terms(error: ApiError) -> ApiError:
    """An error about the response's job, naming the field as the Responses request calls it."""
    name = _JOB_FIELDS.get(error.param or "")
    if name is None:
        return error
    message = error.message.replace(f"{error.param}:", f"{name}:", 1)
    return ApiError(error.status, message, param=name, code=error.code, headers=error.headers)


def response_job(
    body: ResponseRequest, model: str, messages: list[ChatMessage], guided: ResponseFormat | None
) -> JobRequest:
    fields: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": body.top_p,
        "response_format": guided,
        "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
        "cache_salt": body.cache_salt,
        "close_early": body.close_early,
    }
    try:
        return JobRequest.model_validate({key: value for key, value in fields.items() if value is not None})
    except ValidationError as e:
        raise in_responses_terms(validation_error(e, 400)) from e
