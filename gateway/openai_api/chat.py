"""`POST /v1/chat/completions`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.wire import Usage
from gateway.errors import ApiError
from gateway.openai_api.choices import ChoiceResult
from gateway.openai_api.logprobs import TextOffsets, chat_logprobs
from gateway.openai_api.params import job_messages, job_request, reject_unsupported
from gateway.openai_api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageIn,
    ChatMessageOut,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    OpenAIFinishReason,
    ToolCall,
    ToolCallDelta,
)
from gateway.openai_api.serving import completion_operation, respond, served_model, submit_choices
from gateway.openai_api.structured import response_format, with_schema_shown
from gateway.openai_api.tool_calls import CallReader, read_answer
from gateway.openai_api.tools import TEXT_AFTER_TOOLS, ToolPlan, check_schemas, tool_plan, with_tools
from gateway.request_body import parse_body
from gateway.state import app_state
from gateway.streaming.sse import StreamEndpoint


def _has_tool_turns(messages: list[ChatMessageIn]) -> bool:
    return any(m.role in ("tool", "function") or m.tool_calls or m.function_call for m in messages)


@dataclass(frozen=True)
class ChatFormat:
    id: str
    created: int
    model: str
    count: int
    logprobs: bool = False  # the request asked for logprobs
    tools: ToolPlan | None = None  # the answer may be calls, read from its text
    _readers: dict[int, CallReader] = field(default_factory=dict)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def opening(self) -> list[ChatCompletionChunk]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
            for i in range(self.count)
        ]

    def text(self, index: int, text: str) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(content=text))])

    def tokens(
        self, index: int, text: str, logprobs: list[dict[str, Any]], offsets: TextOffsets
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=Delta(content=text), logprobs=chat_logprobs(logprobs))
        return self._chunk([choice])

    def prompt(self, index: int, logprobs: list[dict[str, Any]], offsets: TextOffsets) -> None:
        return None  # chat never echoes

    def finish(
        self, index: int, reason: OpenAIFinishReason, closed_early: bool | None = None
    ) -> ChatCompletionChunk:
        reader = self._readers.get(index)
        if reader is not None and reader.made_calls:
            reason = self._calls_reason(reason, bool(reader.complete_calls()))
        choice = ChatChunkChoice(index=index, delta=Delta(), finish_reason=reason, closed_early=closed_early)
        return self._chunk([choice])

    def read_text(
        self, index: int, text: str, logprobs: list[dict[str, Any]] | None
    ) -> Sequence[ChatCompletionChunk] | None:
        """With tools, each piece of text is read: text goes out as content (with its logprobs), calls as
        `delta.tool_calls` (or the legacy `delta.function_call`)."""
        if self.tools is None or not self.tools.calls_allowed:
            return None
        reader = self._readers.setdefault(index, CallReader())
        plain, pieces = reader.feed(text)
        chunks = []
        if plain and logprobs is not None:
            chunk = ChatChunkChoice(index=index, delta=Delta(content=plain), logprobs=chat_logprobs(logprobs))
            chunks.append(self._chunk([chunk]))
        elif plain:
            chunks.append(self.text(index, plain))
        for piece in pieces:
            if self.tools.legacy:
                call = FunctionCallDelta(name=piece.name, arguments=piece.arguments)
                delta = Delta(function_call=call)
            else:
                first = piece.name is not None
                call_delta = ToolCallDelta(
                    index=piece.index,
                    id=piece.id if first else None,
                    type="function" if first else None,
                    function=FunctionCallDelta(name=piece.name, arguments=piece.arguments),
                )
                delta = Delta(tool_calls=[call_delta])
            chunks.append(self._chunk([ChatChunkChoice(index=index, delta=delta)]))
        return chunks

    def _calls_reason(self, reason: OpenAIFinishReason, complete: bool) -> OpenAIFinishReason:
        if reason != "stop" or not complete:
            return reason
        return "function_call" if self.tools is not None and self.tools.legacy else "tool_calls"

    def _message(self, result: ChoiceResult) -> tuple[ChatMessageOut, OpenAIFinishReason]:
        if self.tools is None or not self.tools.calls_allowed:
            return ChatMessageOut(content=result.text), result.finish_reason
        reader = read_answer(result.text)
        if not reader.made_calls:
            return ChatMessageOut(content=reader.text), result.finish_reason
        calls = reader.complete_calls()
        reason = self._calls_reason(result.finish_reason, bool(calls))
        functions = [FunctionCall(name=call.name, arguments=call.arguments) for call in calls]
        if self.tools.legacy:
            return ChatMessageOut(content=None, function_call=functions[0] if functions else None), reason
        tool_calls = [ToolCall(id=call.id, function=f) for call, f in zip(calls, functions, strict=True)]
        return ChatMessageOut(content=None, tool_calls=tool_calls or None), reason

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def complete(self, results: list[ChoiceResult], usage: Usage) -> ChatCompletion:
        choices = []
        for i, r in enumerate(results):
            message, reason = self._message(r)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=chat_logprobs(r.logprobs or []) if self.logprobs else None,
                    finish_reason=reason,
                    closed_early=r.closed_early,
                )
            )
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )


@completion_operation(
    "OpenAI-compatible chat completion", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk
)
async def create_chat_completion(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, ChatCompletionRequest, invalid_status=400)
    reject_unsupported(body)
    tools = tool_plan(body)
    messages = with_tools(job_messages(body.messages), tools)
    asked = response_format(body)
    guided = asked
    if tools is not None and tools.calls_allowed:
        if asked is not None:
            raise ApiError(
                400, "response_format: not with tool calls; leave it unset", param="response_format"
            )
        await check_schemas(tools)
        guided = tools.response_format()
    elif asked is None:
        if _has_tool_turns(body.messages):
            guided = TEXT_AFTER_TOOLS
    else:
        messages = with_schema_shown(messages, asked, state.settings.structured_output_prompt)
    served = await served_model(state, body.model)
    n = body.choices_per_prompt
    jobs = [job_request(body, served.name, k, messages=messages, guided=guided) for k in range(n)]
    choices = await submit_choices(request, served.model, jobs, [0] * n, "messages")
    created = int(time.time())
    form = ChatFormat(f"chatcmpl-{choices.job_ids[0]}", created, served.name, n, bool(body.logprobs), tools)
    return await respond(request, choices, form, body)


routes = [Route("/v1/chat/completions", StreamEndpoint(create_chat_completion), methods=["POST"])]
