"""Each choice of an OpenAI request is one ortfleet job: submitting them, following them, ending them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from common import keys
from common.apikeys import Principal
from common.events import is_final
from common.records import load_record
from common.wire import EventType, JobRequest, JobStatus, Usage
from gateway.errors import ApiError
from gateway.openai_api.protocol import OpenAIFinishReason
from gateway.state import AppState
from gateway.submission import submit_job

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
EXPIRED_IN_QUEUE = "expired_in_queue"
JOB_ID_HEADER = "X-Ortfleet-Job-Id"  # the jobs behind a response, comma-separated in choice order

_FINISH: dict[str, OpenAIFinishReason] = {"stop": "stop", "length": "length", "cancelled": "abort"}


def finish_reason(job_reason: str | None) -> OpenAIFinishReason:
    """OpenAI's name for a job's finish reason; a job cancelled through the job API is vLLM's 'abort'."""
    return _FINISH.get(job_reason or "", "stop")


def as_openai_error(error: ApiError) -> ApiError:
    """The job API answers bad values with 422; OpenAI (and so its SDK) expects 400."""
    if error.status != 422:
        return error
    return ApiError(400, error.message, param=error.param, code=error.code, headers=error.headers)


@dataclass(frozen=True)
class ChoiceEvent:
    index: int
    fields: dict[str, str]

    @property
    def kind(self) -> str:
        return self.fields.get("type", "")

    @property
    def started(self) -> bool:
        return self.kind != EventType.status.value or self.fields.get("status") != JobStatus.queued.value

    def usage(self) -> Usage:
        raw = self.fields.get("usage")
        return Usage.model_validate_json(raw) if raw else Usage()


@dataclass(frozen=True)
class ChoiceResult:
    text: str
    finish_reason: OpenAIFinishReason
    usage: Usage


class Choices:
    """The jobs behind one OpenAI request, in choice order; `prompt_of` maps a choice to its prompt."""

    def __init__(
        self, state: AppState, model: str, job_ids: list[str], prompt_of: list[int], prompt_param: str
    ) -> None:
        self.state = state
        self.model = model
        self.job_ids = job_ids
        self.prompt_of = prompt_of
        self.prompt_param = prompt_param

    @classmethod
    async def submit(
        cls,
        state: AppState,
        model: str,
        requests: list[JobRequest],
        prompt_of: list[int],
        *,
        prompt_param: str,
        owner: Principal,
    ) -> Choices:
        """Submits one job per choice; if one is refused (queue full), the ones before it are cancelled."""
        choices = cls(state, model, [], prompt_of, prompt_param)
        try:
            for request in requests:
                choices.job_ids.append((await submit_job(state, request, None, owner)).job_id)
        except BaseException as e:
            await asyncio.shield(choices.cancel())
            if isinstance(e, ApiError):
                raise as_openai_error(e) from e
            raise
        return choices

    async def cancel(self) -> None:
        await asyncio.gather(*(self.state.queue.cancel(job_id, self.model) for job_id in self.job_ids))

    async def events(self, tick_s: float) -> AsyncGenerator[ChoiceEvent | None, None]:
        """Every job's stream entries as they come, until each job's final one; None after `tick_s` idle."""
        index = {keys.events(job_id): i for i, job_id in enumerate(self.job_ids)}
        after = dict.fromkeys(index, "0-0")
        while after:
            reply = await self.state.redis.xread(after, count=512, block=max(1, int(tick_s * 1000)))  # type: ignore[arg-type]
            if not reply:
                yield None
                continue
            for stream, entries in reply:
                for entry_id, fields in entries:
                    after[stream] = entry_id
                    yield ChoiceEvent(index[stream], fields)
                    if is_final(fields):
                        del after[stream]
                        break

    async def wait_started(
        self, events: AsyncIterator[ChoiceEvent | None], limit_s: float
    ) -> list[ChoiceEvent]:
        """The events until every job has started (or ended), for at most `limit_s`.

        A job fails before it starts when its prompt is longer than the model's context: waiting
        for the start turns that into an HTTP error rather than an error inside a 200 stream.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        waiting = set(range(len(self.job_ids)))
        seen: list[ChoiceEvent] = []
        async for event in events:
            if event is not None:
                seen.append(event)
                if event.kind == EventType.error.value:
                    await self.cancel()
                    raise self.failure(event)
                if event.started:
                    waiting.discard(event.index)
            if not waiting or loop.time() >= deadline:
                break
        return seen

    async def results(self, events: AsyncIterator[ChoiceEvent | None]) -> list[ChoiceResult]:
        """Waits for every job to end and returns what each one generated."""
        async for event in events:
            if event is not None and event.kind == EventType.error.value:
                await self.cancel()
                raise self.failure(event)
        results = []
        for job_id in self.job_ids:
            record = await load_record(self.state.redis, job_id) or {}
            usage = record.get("usage")
            results.append(
                ChoiceResult(
                    record.get("output", ""),
                    finish_reason(record.get("finish_reason")),
                    Usage.model_validate_json(usage) if usage else Usage(),
                )
            )
        return results

    def failure(self, event: ChoiceEvent) -> ApiError:
        """The error for a failed job: 400 for a prompt longer than the context, 503 for one that waited
        too long in the queue, else 500."""
        message = event.fields.get("message") or "the job failed"
        code = event.fields.get("code")
        job = self.job_ids[event.index]
        headers = {JOB_ID_HEADER: job}
        if code == CONTEXT_LENGTH_EXCEEDED:
            return ApiError(400, message, param=self.prompt_param, code=code, headers=headers)
        if code == EXPIRED_IN_QUEUE:  # the fleet was too busy to start it in time: worth a retry
            return ApiError(503, f"job {job} {message}", code=code, headers={**headers, "Retry-After": "5"})
        return ApiError(500, f"job {job} failed: {message}", code=code or "job_failed", headers=headers)

    def total_usage(self, usages: list[Usage]) -> Usage:
        """Completion tokens of every choice; prompt tokens once per prompt (n choices share one)."""
        prompts: dict[int, int] = {}
        for prompt, usage in zip(self.prompt_of, usages, strict=True):
            prompts[prompt] = max(prompts.get(prompt, 0), usage.prompt_tokens)
        completion = sum(usage.completion_tokens for usage in usages)
        prompt_tokens = sum(prompts.values())
        return Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion
        )
