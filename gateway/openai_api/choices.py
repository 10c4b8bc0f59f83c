"""Each choice of an OpenAI request is one ortfleet job: submitting them, following them, ending them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from common.apikeys import Principal
from common.error_codes import ErrorCode
from common.events import entry_logprobs, is_failure, is_final
from common.wire import EventType, JobRequest, JobStatus, PromptTokensDetails, Usage
from gateway.errors import ApiError
from gateway.openai_api.protocol import OpenAIFinishReason
from gateway.placement import check_choices_fit
from gateway.shards import Shard
from gateway.state import AppState
from gateway.streaming.follower import Follower
from gateway.streaming.ids import KeyedEntry
from gateway.streaming.reading import PURGED, SentTokens, stream_exists
from gateway.submission import submit_job

logger = logging.getLogger(__name__)

JOB_ID_HEADER = "X-Ortfleet-Job-Id"  # the jobs behind a response, comma-separated in choice order

_FINISH: dict[str, OpenAIFinishReason] = {"stop": "stop", "length": "length", "cancelled": "length"}


def finish_reason(job_reason: str | None) -> OpenAIFinishReason:
    """OpenAI's name for a job's finish reason. A job cancelled through the job API was cut short: of
    OpenAI's reasons, `length` is the one that says the text is incomplete (vLLM says `abort`, which
    OpenAI's clients do not know)."""
    return _FINISH.get(job_reason or "", "stop")


def _error_code(raw: str | None) -> ErrorCode | None:
    try:
        return ErrorCode(raw) if raw else None
    except ValueError:
        return None


def job_failure(job_id: str, message: str | None, code: ErrorCode | None, prompt_param: str) -> ApiError:
    """The error for a failed job, as a call that waited for it is answered: 400 for what the request
    asked that cannot be done (a prompt longer than the context, a grammar the engine cannot compile, a
    prompt the tokenizer cannot take, logprobs from an engine without logits, a logit_bias token the
    model does not have), 404 for a purged job, 503 for one that waited too long in the
    queue, one lost with its Redis's data, or one whose Redis stayed away for the outage limit
    (`store_unavailable`: the job may still run), else 500 with its code (`job_failed` when the worker
    named none).

    An engine or worker failure is the server's, and OpenAI answers its own with 500 `server_error`, as
    vLLM does an engine error: the SDK raises InternalServerError (and retries it, as a new job). Not
    502: the gateway did hear from its worker, whose answer is the job's failure."""
    message = message or "the job failed"
    headers = {JOB_ID_HEADER: job_id}
    if code in (ErrorCode.context_length_exceeded, ErrorCode.invalid_prompt):
        return ApiError(400, message, param=prompt_param, code=code, headers=headers)
    if code is ErrorCode.max_tokens_too_small:
        return ApiError(400, message, param="max_tokens", code=code, headers=headers)
    if code is ErrorCode.invalid_response_format:
        return ApiError(400, message, param="response_format", code=code, headers=headers)
    if code in (ErrorCode.unsupported_parameter, ErrorCode.unsupported_value):  # "<param>: why" (worker)
        return ApiError(400, message, param=message.partition(":")[0], code=code, headers=headers)
    if code is ErrorCode.job_purged:
        return ApiError(404, f"job {job_id} {message}", code=code, headers=headers)
    if code is ErrorCode.expired_in_queue:  # the fleet was too busy to start it in time: worth a retry
        return ApiError(503, f"job {job_id} {message}", code=code, headers={**headers, "Retry-After": "5"})
    # Redis lost its data (the job is gone, a new one may run), or stayed away past the outage limit
    if code in (ErrorCode.store_lost, ErrorCode.store_unavailable):
        return ApiError(503, f"job {job_id}: {message}", code=code, headers={**headers, "Retry-After": "1"})
    code = code or ErrorCode.job_failed
    return ApiError(500, f"job {job_id} failed: {message}", code=code, headers=headers)


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
    def failed(self) -> bool:
        return is_failure(self.fields)

    @property
    def started(self) -> bool:
        return self.kind != EventType.status.value or self.fields.get("status") != JobStatus.queued.value

    @property
    def logprobs(self) -> list[dict[str, Any]] | None:
        return entry_logprobs(self.fields) if self.kind == EventType.token.value else None

    @property
    def prompt_logprobs(self) -> list[dict[str, Any]] | None:
        return entry_logprobs(self.fields) if self.kind == EventType.prompt.value else None

    def usage(self) -> Usage:
        raw = self.fields.get("usage")
        return Usage.model_validate_json(raw) if raw else Usage()


@dataclass(frozen=True)
class ChoiceResult:
    text: str
    finish_reason: OpenAIFinishReason
    usage: Usage
    logprobs: list[dict[str, Any]] | None = None  # one entry per token (common/events.py), when asked
    prompt_logprobs: list[dict[str, Any]] | None = None  # one entry per prompt token, when asked
    closed_early: bool | None = None  # True: closed early within max_tokens; False: cut, closing off


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
        self._slot_owner: str | None = None
        self._store: Shard | None = None  # the store of the model its jobs went to (all to one)

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
        """Submits one job per choice; if one is refused (queue full), the ones before it are cancelled.

        The request holds one of its key's stream slots until `release`: it waits on Redis meanwhile.
        """
        check_choices_fit(
            len(requests), owner.max_concurrent_jobs or 0, len(state.shards.stores_of(model)), model
        )
        state.streams.take(owner.name)
        choices = cls(state, model, [], prompt_of, prompt_param)
        choices._slot_owner = owner.name
        try:
            for request in requests:  # one store for all: the request follows its jobs on one relay
                submitted = await submit_job(state, request, None, owner, store=choices._store)
                choices.job_ids.append(submitted.job_id)
                choices._store = choices._store or state.shards.of_job(submitted.job_id, model)
        except BaseException as e:
            choices.release()
            await asyncio.shield(choices.cancel())
            if isinstance(e, ApiError):
                raise as_openai_error(e) from e
            raise
        return choices

    def release(self) -> None:
        """Give back the key's stream slot (once)."""
        if self._slot_owner is not None:
            self.state.streams.give_back(self._slot_owner)
            self._slot_owner = None

    @property
    def shard(self) -> Shard:
        """The store of the model that holds the request's jobs."""
        return self._store or self.state.shards.of_model(self.model)

    async def cancel(self) -> None:
        """Cancels the jobs; a store that does not answer leaves them to run (the caller's answer, an
        error, is the same either way)."""
        outcomes = await asyncio.gather(
            *(self.shard.queue.cancel(job_id, self.model) for job_id in self.job_ids), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, RedisError):
                logger.warning("jobs %s not cancelled: Redis did not answer (%s)", self.job_ids, outcome)
                return
            if isinstance(outcome, BaseException):
                raise outcome

    def events(self, tick_s: float) -> ChoiceEvents:
        """Follows every job's stream from its start (see ChoiceEvents)."""
        return ChoiceEvents(self, tick_s)

    async def wait_started(
        self, events: AsyncIterator[list[ChoiceEvent]], limit_s: float
    ) -> list[ChoiceEvent]:
        """The events until every job has started (or ended), for at most `limit_s`, and the rest of
        the read that started the last one.

        A job fails before it starts when its prompt is longer than the model's context: waiting
        for the start turns that into an HTTP error rather than an error inside a 200 stream.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        waiting = set(range(len(self.job_ids)))
        seen: list[ChoiceEvent] = []
        async for read in events:
            for event in read:
                seen.append(event)
                if not waiting:
                    continue  # started: what follows goes in the stream, errors too
                if event.failed:
                    await self.cancel()
                    raise self.failure(event)
                if event.started:
                    waiting.discard(event.index)
            if not waiting or loop.time() >= deadline:
                break
        return seen

    async def results(self, events: AsyncIterator[list[ChoiceEvent]]) -> list[ChoiceResult]:
        """Waits for every job to end and returns what each one generated."""
        logprobs: list[list[dict[str, Any]] | None] = [None] * len(self.job_ids)
        prompts: list[list[dict[str, Any]] | None] = [None] * len(self.job_ids)
        async for read in events:
            for event in read:
                if event.failed:
                    await self.cancel()
                    raise self.failure(event)
                if (entries := event.prompt_logprobs) is not None:
                    prompts[event.index] = entries  # an attempt that wrote it again wrote the same
                    continue
                if (entries := event.logprobs) is not None:
                    found = logprobs[event.index]
                    if found is None:
                        logprobs[event.index] = entries
                    else:
                        found.extend(entries)
        results = []
        for job_id, entries, prompt in zip(self.job_ids, logprobs, prompts, strict=True):
            record = await self.shard.queue.record(job_id)
            if record is None:
                results.append(ChoiceResult("", finish_reason(None), Usage()))
                continue
            reason = record.finish_reason.value if record.finish_reason else None
            usage = record.usage or Usage()
            text, reason_name = record.output or "", finish_reason(reason)
            closed = record.closed_early
            results.append(ChoiceResult(text, reason_name, usage, entries, prompt, closed_early=closed))
        return results

    def failure(self, event: ChoiceEvent) -> ApiError:
        """The error for the job whose failure `event` is (see job_failure)."""
        fields = event.fields
        job_id = self.job_ids[event.index]
        return job_failure(job_id, fields.get("message"), _error_code(fields.get("code")), self.prompt_param)

    def total_usage(self, usages: list[Usage]) -> Usage:
        """Completion tokens of every choice; prompt tokens once per prompt (n choices share one)."""
        prompts: dict[int, int] = {}
        cached: dict[int, int] = {}
        for prompt, usage in zip(self.prompt_of, usages, strict=True):
            prompts[prompt] = max(prompts.get(prompt, 0), usage.prompt_tokens)
            if usage.cached_tokens is not None:
                cached[prompt] = max(cached.get(prompt, 0), usage.cached_tokens)
        completion = sum(usage.completion_tokens for usage in usages)
        prompt_tokens = sum(prompts.values())
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())) if cached else None,
        )


class ChoiceEvents:
    """The entries of a request's job streams, from their start, until each job's final one: each read's
    fresh entries together, as ChoiceEvents. Iterate them (a task waits; an empty list after `tick_s`
    with nothing new, or the ends of jobs purged meanwhile), or `push_to` a callback, which `take`s
    each read in the relay's own turn of the event loop. `aclose` stops following.

    A job's Redis away for the relay's outage limit ends each stream still followed with an error
    event of code `store_unavailable` (the relay's `outage_end`): the caller answers it as a failed job
    (503, or an in-stream error)."""

    def __init__(self, choices: Choices, tick_s: float) -> None:
        self._choices = choices
        self._tick_s = tick_s
        self._index = {choices.shard.keys.events(job_id): i for i, job_id in enumerate(choices.job_ids)}
        self._sent = {stream: SentTokens() for stream in self._index}
        self._following = set(self._index)
        self._follower: Follower = choices.shard.relay.follower(dict.fromkeys(self._index, "0-0"))

    @property
    def over(self) -> bool:
        """Every job's final entry has been read (or following stopped)."""
        return not self._following

    def __aiter__(self) -> ChoiceEvents:
        return self

    async def __anext__(self) -> list[ChoiceEvent]:
        while not self.over:
            entries = await self._follower.next(self._tick_s)
            if not entries:
                return await self.purged()
            if read := self._fresh(entries):
                return read
        raise StopAsyncIteration

    def push_to(self, on_arrival: Callable[[], None]) -> None:
        self._follower.push_to(on_arrival)

    def take(self) -> list[ChoiceEvent]:
        """With `push_to`: the read the relay handed over."""
        return self._fresh(self._follower.take())

    @property
    def behind(self) -> bool:
        return self._follower.behind

    def pause(self) -> None:
        self._follower.pause()

    def rejoin(self) -> None:
        self._follower.rejoin()

    def _fresh(self, entries: list[KeyedEntry]) -> list[ChoiceEvent]:
        read = []
        for stream, _entry_id, fields in entries:
            if stream not in self._following or not self._sent[stream].fresh(fields):
                continue
            read.append(ChoiceEvent(self._index[stream], fields))
            if is_final(fields):
                self._following.discard(stream)
                self._follower.stop(stream)
        return read

    async def purged(self) -> list[ChoiceEvent]:
        """After a quiet spell: the end of each job whose stream was purged (it would never end by
        itself); none while Redis is away, the end of every job once it has been away for the outage
        limit (the relay ends them then: this catches one it missed)."""
        shard = self._choices.shard
        if shard.relay.outage_over():
            ended = [(stream, shard.relay.outage_end()) for stream in self._following]
        else:
            ended = []
            for stream in list(self._following):  # a push may end one meanwhile
                exists = await stream_exists(shard.relay, shard.redis, stream)
                if exists is None:  # Redis away: none is known to be gone
                    return []
                if not exists and stream in self._following:
                    ended.append((stream, PURGED))
        for stream, _fields in ended:
            self._following.discard(stream)
            self._follower.stop(stream)
        return [ChoiceEvent(self._index[stream], fields) for stream, fields in ended]

    async def aclose(self) -> None:
        self._following.clear()
        self._follower.close()
