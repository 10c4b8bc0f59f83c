"""`POST /v1/chat/completions`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.wire import Usage
from gateway.auth import principal_of
from gateway.openai_api.choices import ChoiceResult, Choices
from gateway.openai_api.logprobs import TextOffsets, chat_logprobs
from gateway.openai_api.params import job_messages, job_request, reject_unsupported
from gateway.openai_api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageOut,
    Delta,
    OpenAIFinishReason,
)
from gateway.openai_api.serving import respond, served_model
from gateway.request_body import parse_body
from gateway.sse import StreamEndpoint
from gateway.state import app_state


@dataclass(frozen=True)
class ChatFormat:
    id: str
    created: int
    model: str
    count: int
    logprobs: bool = False  # the request asked for logprobs

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

    def finish(self, index: int, reason: OpenAIFinishReason) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(), finish_reason=reason)])

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def complete(self, results: list[ChoiceResult], usage: Usage) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=i,
                message=ChatMessageOut(content=r.text),
                logprobs=chat_logprobs(r.logprobs or []) if self.logprobs else None,
                finish_reason=r.finish_reason,
            )
            for i, r in enumerate(results)
        ]
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )


async def create_chat_completion(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, ChatCompletionRequest, invalid_status=400)
    reject_unsupported(body)
    messages = job_messages(body.messages)
    model = await served_model(state, body.model)
    n = body.choices_per_prompt
    jobs = [job_request(body, model, k, messages=messages) for k in range(n)]
    owner = principal_of(request.scope)
    choices = await Choices.submit(state, model, jobs, [0] * n, prompt_param="messages", owner=owner)
    form = ChatFormat(f"chatcmpl-{choices.job_ids[0]}", int(time.time()), model, n, bool(body.logprobs))
    return await respond(
        request,
        choices,
        form,
        stream=body.streaming,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
    )


routes = [Route("/v1/chat/completions", StreamEndpoint(create_chat_completion), methods=["POST"])]
