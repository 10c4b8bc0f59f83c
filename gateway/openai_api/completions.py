"""`POST /v1/completions` (text completions)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.wire import Usage
from gateway.openai_api.choices import ChoiceResult
from gateway.openai_api.logprobs import TextOffsets, completion_logprobs
from gateway.openai_api.params import check_choice_count, job_request, prompt_texts, reject_unsupported
from gateway.openai_api.protocol import Completion, CompletionChoice, CompletionRequest, OpenAIFinishReason
from gateway.openai_api.serving import completion_operation, respond, served_model, submit_choices
from gateway.openai_api.structured import response_format
from gateway.request_body import parse_body
from gateway.state import app_state
from gateway.streaming.sse import StreamEndpoint


@dataclass(frozen=True)
class CompletionFormat:
    id: str
    created: int
    model: str
    logprobs: bool = False  # the request asked for logprobs
    echoed: tuple[str, ...] | None = None  # each choice's prompt, when the request asked for it back

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self) -> list[Completion]:
        """The echoed prompts; with logprobs they come with their prompt events instead (`prompt`)."""
        if self.echoed is None or self.logprobs:
            return []
        return [self.text(index, prompt) for index, prompt in enumerate(self.echoed)]

    def prompt(self, index: int, logprobs: list[dict[str, Any]], offsets: TextOffsets) -> Completion | None:
        if self.echoed is None:
            return None
        return self.tokens(index, self.echoed[index], logprobs, offsets)

    def text(self, index: int, text: str) -> Completion:
        return self._chunk([CompletionChoice(index=index, text=text, finish_reason=None)])

    def tokens(
        self, index: int, text: str, logprobs: list[dict[str, Any]], offsets: TextOffsets
    ) -> Completion:
        found = completion_logprobs(logprobs, offsets)
        return self._chunk([CompletionChoice(index=index, text=text, logprobs=found, finish_reason=None)])

    def finish(self, index: int, reason: OpenAIFinishReason, closed_early: bool | None = None) -> Completion:
        choice = CompletionChoice(index=index, text="", finish_reason=reason, closed_early=closed_early)
        return self._chunk([choice])

    def read_text(self, index: int, text: str, logprobs: list[dict[str, Any]] | None) -> None:
        return None  # text goes out as it comes

    def usage(self, usage: Usage) -> Completion:
        return self._chunk([], usage)

    def complete(self, results: list[ChoiceResult], usage: Usage) -> Completion:
        choices = [
            CompletionChoice(
                index=i,
                text=r.text if self.echoed is None else self.echoed[i] + r.text,
                logprobs=completion_logprobs([*(r.prompt_logprobs or []), *(r.logprobs or [])], TextOffsets())
                if self.logprobs
                else None,
                finish_reason=r.finish_reason,
                closed_early=r.closed_early,
            )
            for i, r in enumerate(results)
        ]
        return self._chunk(choices, usage)


@completion_operation("OpenAI-compatible text completion", CompletionRequest, Completion, Completion)
async def create_completion(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, CompletionRequest, invalid_status=400)
    reject_unsupported(body)
    prompts = prompt_texts(body.prompt)
    n = body.choices_per_prompt
    check_choice_count(len(prompts) * n)
    served = await served_model(state, body.model)
    guided = response_format(body)
    jobs = [
        job_request(body, served.name, k, prompt=prompt, guided=guided)
        for prompt in prompts
        for k in range(n)
    ]
    prompt_of = [i for i in range(len(prompts)) for _ in range(n)]
    choices = await submit_choices(request, served.model, jobs, prompt_of, "prompt")
    echoed = tuple(prompts[i] for i in prompt_of) if body.echo else None
    form = CompletionFormat(
        f"cmpl-{choices.job_ids[0]}", int(time.time()), served.name, body.logprobs is not None, echoed
    )
    return await respond(request, choices, form, body)


routes = [Route("/v1/completions", StreamEndpoint(create_completion), methods=["POST"])]
