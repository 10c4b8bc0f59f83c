"""Runs one claimed job: prompt -> engine -> decoded text in the job's stream -> final record."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from common import keys
from common.events import done_entry, entry_token_ids, status_entry, token_entry
from common.jobqueue import Claim, JobQueue
from common.wire import EventType, FinishReason, JobSpec, JobStatus, Timings, Usage
from worker.engine import Engine, EngineUpdate, Finish, GenerationRequest, GenerationStream, Tokenizer
from worker.publisher import LeaseLost, StreamPublisher
from worker.stop_strings import StopMatcher

logger = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    code = "context_length_exceeded"


@dataclass
class Progress:
    """What earlier attempts of the job already published (empty on a first attempt)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None


@dataclass
class Outcome:
    status: JobStatus
    finish_reason: FinishReason | None
    text: str
    generated: int
    error: str | None = None


class JobRun:
    def __init__(
        self,
        claim: Claim,
        spec: JobSpec,
        *,
        queue: JobQueue,
        engine: Engine,
        tokenizer: Tokenizer,
        publish_max_batch: int,
        worker_id: str,
    ) -> None:
        self.worker_id = worker_id
        self.claim = claim
        self.spec = spec
        self._queue = queue
        self._engine = engine
        self._tokenizer = tokenizer
        self._publish_max_batch = publish_max_batch
        self._stream: GenerationStream | None = None
        self._cancelled = False
        self._abandoned = False
        self.progress = Progress()
        self.started_at = time.time()
        self.batch_peak = 0
        self.prompt_tokens = 0
        self.tokens_generated = 0  # by this attempt
        self._token_times: list[float] = []
        self.outcome: Outcome | None = None
        self.engine_done = False  # the engine has finished with this job (its slot is free)
        self.on_engine_done: Callable[[], None] | None = None

    @property
    def job_id(self) -> str:
        return self.claim.job_id

    @property
    def token_times(self) -> list[float]:
        """When this attempt received each batch of tokens from the engine (wall clock)."""
        return self._token_times

    def abandon(self) -> None:
        """Stop generating without finishing the job: it goes back to the queue and resumes elsewhere."""
        self._abandoned = True
        self.cancel()

    def cancel(self) -> None:
        self._cancelled = True
        if self._stream is not None:
            self._engine.cancel(self._stream)

    async def load_progress(self) -> None:
        """Reads a cancel that raced the claim and, on a retry, the tokens already streamed."""
        redis = self._queue.redis
        fields = ["cancel_requested", "first_token_at"]
        cancel, first = await redis.hmget(keys.job(self.job_id), fields)  # type: ignore[misc]
        if cancel:
            self._cancelled = True
        if self.claim.attempt == 1:
            return
        self.progress.first_token_at = float(first) if first else None
        for _entry_id, fields in await redis.xrange(keys.events(self.job_id)):
            if fields.get("type") == EventType.token.value:
                self.progress.token_ids += entry_token_ids(fields)
                self.progress.text += fields.get("text", "")

    def prompt_ids(self) -> list[int]:
        if self.spec.messages is not None:
            messages = json.dumps([m.model_dump() for m in self.spec.messages])
            text = self._tokenizer.apply_chat_template(messages)
        else:
            assert self.spec.prompt is not None
            text = self.spec.prompt
        return self._tokenizer.encode(text)

    def engine_request(self, prompt_ids: list[int]) -> GenerationRequest | None:
        """What to ask the engine for; None when nothing is left to generate (or the job was cancelled)."""
        self.prompt_tokens = len(prompt_ids)
        context = self._engine.context_length
        if len(prompt_ids) >= context:
            raise PromptTooLong(
                f"the prompt is {len(prompt_ids)} tokens, but model {self.spec.model!r} has a context of "
                f"{context} tokens (prompt and generated tokens together)"
            )
        sampling = self.spec.sampling
        wanted = (sampling.max_tokens or context) - len(self.progress.token_ids)
        self._room = context - len(prompt_ids) - len(self.progress.token_ids)
        self._max_new = max(0, min(wanted, self._room))
        if self._cancelled or self._max_new == 0:
            return None
        return GenerationRequest(
            prompt_ids=prompt_ids + self.progress.token_ids,
            max_new_tokens=self._max_new,
            min_new_tokens=max(0, min(sampling.min_tokens - len(self.progress.token_ids), self._max_new)),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            stop=sampling.stop,
        )

    def attach(self, stream: GenerationStream) -> None:
        self._stream = stream

    async def run(self) -> None:
        publisher = StreamPublisher(self._queue, self.job_id, self.claim.attempt, self._publish_max_batch)
        publisher.add(status_entry(JobStatus.running, attempt=self.claim.attempt, worker=self.worker_id))
        try:
            outcome = await self._generate(publisher)
            self._release_engine()  # the slot is free while the last writes go out
            await publisher.drain()
        except LeaseLost:
            if self._stream is not None and not self._stream.cancel_requested:
                self._engine.cancel(self._stream)
            return
        finally:
            await publisher.close()
        if not self._abandoned:
            await self._finish(outcome)

    def _release_engine(self) -> None:
        self.engine_done = True
        if self.on_engine_done is not None:
            self.on_engine_done()

    async def _generate(self, publisher: StreamPublisher) -> Outcome:
        done_before = len(self.progress.token_ids)
        if self._stream is None:
            reason = FinishReason.cancelled if self._cancelled else FinishReason.length
            status = JobStatus.cancelled if self._cancelled else JobStatus.succeeded
            return Outcome(status, reason, self.progress.text, done_before)
        decoder = self._tokenizer.stream_decoder()
        for token in self.progress.token_ids:
            decoder.decode(token)
        matcher = StopMatcher(self.spec.sampling.stop or []) if not self._engine.continuous_batching else None
        text = self.progress.text
        generated = done_before
        while True:
            update: EngineUpdate = await self._stream.updates.get()
            self.batch_peak = max(self.batch_peak, update.batch_rows)
            pieces = []
            hit_stop = False
            for token in update.token_ids:
                generated += 1
                piece = decoder.decode(token)
                if matcher is not None:
                    piece, hit_stop = matcher.feed(piece)
                pieces.append(piece)
                if hit_stop:
                    break
            if update.token_ids:
                now = time.time()
                self._token_times.append(now)
                self.tokens_generated += len(update.token_ids)
                chunk = "".join(pieces)
                index = generated - len(update.token_ids)
                record = None
                if self.progress.first_token_at is None:
                    self.progress.first_token_at = now
                    record = {"first_token_at": str(now)}
                publisher.add(token_entry(chunk, update.token_ids[: len(pieces)], index), record)
                text += chunk
            if hit_stop:
                self._engine.cancel(self._stream)
                await self._drain_engine()
                return Outcome(JobStatus.succeeded, FinishReason.stop, text, generated)
            if update.finish is None:
                continue
            if matcher is not None:
                tail = matcher.flush()
                if tail:
                    publisher.add(token_entry(tail, [], generated))
                    text += tail
            return self._outcome(update, text, generated)

    async def _drain_engine(self) -> None:
        assert self._stream is not None
        while (await self._stream.updates.get()).finish is None:
            pass

    def _outcome(self, update: EngineUpdate, text: str, generated: int) -> Outcome:
        finish = update.finish
        if finish is Finish.cancelled or (self._cancelled and finish is not Finish.error):
            return Outcome(JobStatus.cancelled, FinishReason.cancelled, text, generated)
        if finish is Finish.error:
            return Outcome(JobStatus.failed, FinishReason.error, text, generated, update.error)
        if finish is Finish.length:
            return Outcome(JobStatus.succeeded, FinishReason.length, text, generated)
        return Outcome(JobStatus.succeeded, FinishReason.stop, text, generated)

    async def _finish(self, outcome: Outcome) -> None:
        now = time.time()
        submitted = self.spec.submitted_at
        usage = Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=outcome.generated,
            total_tokens=self.prompt_tokens + outcome.generated,
        )
        first = self.progress.first_token_at
        times = self._token_times
        timings = Timings(
            queue_wait_s=round(self.started_at - submitted, 6),
            ttft_s=round(first - submitted, 6) if first else None,
            time_per_output_token_s=round((times[-1] - times[0]) / (outcome.generated - 1), 6)
            if len(times) > 1 and outcome.generated > 1
            else None,
            total_s=round(now - submitted, 6),
        )
        record = {
            "status": outcome.status.value,
            "output": outcome.text,
            "usage": usage.model_dump_json(),
            "timings": timings.model_dump_json(),
            "finished_at": str(now),
            "engine_batch_peak": str(self.batch_peak),
        }
        if outcome.finish_reason is not None:
            record["finish_reason"] = outcome.finish_reason.value
        if outcome.error:
            record["error"] = outcome.error
        reason = outcome.finish_reason.value if outcome.finish_reason else None
        final = done_entry(outcome.status, reason, usage.model_dump_json())
        if outcome.error:
            final["message"] = outcome.error
        await self._write_final(record, final)
        self.outcome = outcome

    async def _write_final(self, record: dict[str, str], final: dict[str, str]) -> None:
        """Retries through a Redis outage: a finished job is never lost (writes stay fenced)."""
        delay = 0.1
        while True:
            try:
                await self._queue.finish(self.job_id, self.spec.model, self.claim.attempt, record, final)
                return
            except RedisError as e:
                logger.warning("job %s: writing the result failed (%s); retrying", self.job_id, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
