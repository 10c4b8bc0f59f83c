"""Runs one claimed job: prompt -> engine -> decoded text in the job's stream -> final record."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from common.error_codes import ErrorCode
from common.events import entry_token_ids, prompt_entry
from common.jobs.claims import Claim
from common.jobs.queue import JobQueue
from common.jobs.record import RecordUpdate
from common.wire import EventType, FinishReason, JobSpec, JobStatus
from worker import job_request
from worker.attempt_writes import Outcome, final_writes, running_writes, write_final
from worker.engine import (
    Engine,
    EngineUpdate,
    Finish,
    GenerationRequest,
    GenerationStream,
    StreamDecoder,
    Tokenizer,
)
from worker.logprob_entries import LogprobEntries
from worker.publisher import LeaseLost, StepWriter, StreamPublisher
from worker.stop_strings import StopMatcher

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """What earlier attempts of the job already published (empty on a first attempt)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None


@dataclass
class _Decoding:
    """Where a job's text stands while its tokens come in."""

    decoder: StreamDecoder
    matcher: StopMatcher | None
    stop_ids: frozenset[int]
    pieces: list[str]  # the text so far, joined only at the end (not copied whole at every token)
    generated: int = 0  # tokens generated so far, earlier attempts' included
    stopped: bool = False  # a stop token or string ended the text: the engine is being stopped

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class JobRun:
    def __init__(
        self,
        claim: Claim,
        spec: JobSpec,
        *,
        queue: JobQueue,
        engine: Engine,
        tokenizer: Tokenizer,
        writer: StepWriter,
        worker_id: str,
        replay: bool = True,
    ) -> None:
        self.worker_id = worker_id
        self._replay = replay  # resume by replaying the published tokens (else: one prefill of them)
        self.claim = claim
        self.spec = spec
        self._queue = queue
        self._engine = engine
        self._tokenizer = tokenizer
        asked = spec.sampling.logprobs is not None or spec.sampling.prompt_logprobs is not None
        self._logprob_entries = LogprobEntries(tokenizer) if asked else None
        self._writer = writer
        self._stream: GenerationStream | None = None
        self._cancelled = False
        self._abandoned = False
        self._preempting = False  # asked to stop for another job (see preempted)
        self.preempted = False  # stopped for another job: its worker gives it back to the queue
        self.preemptions = 0  # times the job was preempted before this attempt
        self.weight = 1.0  # its owner's weight when it was submitted
        self.lost = False  # the engine failed under it: its worker gives it back to the queue
        self.progress = Progress()
        self.started_at = time.time()
        self.batch_peak = 0
        self.prompt_tokens = 0
        self.tokens_generated = 0  # by this attempt
        self.cached_tokens: int | None = None  # prompt tokens this attempt's engine reused, if it says
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

    @property
    def preempt_requested(self) -> bool:
        return self._preempting

    def preempt(self) -> None:
        """Stop generating for another job: unless it ends first, the job goes back to the queue, in its
        place, once its streamed tokens are written, and resumes from them."""
        self._preempting = True
        if self._stream is not None and not self._stream.cancel_requested:
            self._engine.cancel(self._stream)

    def cancel(self) -> None:
        self._cancelled = True
        if self._stream is not None:
            self._engine.cancel(self._stream)

    async def load_progress(self) -> None:
        """Reads a cancel that raced the claim, the job's preemptions so far and its owner's weight,
        and, on a retry, the tokens already streamed."""
        record = await self._queue.attempt_start(self.job_id)
        if record is not None and record.cancel_requested:
            self._cancelled = True
        if record is not None:
            self.preemptions, self.weight = record.preemptions, record.weight
        if self.claim.attempt == 1:
            return
        self.progress.first_token_at = record.first_token_at if record is not None else None
        for fields in await self._queue.entries(self.job_id):
            if fields.get("type") != EventType.token.value:
                continue
            if int(fields.get("index", len(self.progress.token_ids))) < len(self.progress.token_ids):
                continue  # written twice (a write retried after a failover): counted once
            self.progress.token_ids += entry_token_ids(fields)
            self.progress.text += fields.get("text", "")

    def prompt_ids(self) -> list[int]:
        return job_request.prompt_ids(self.spec, self._tokenizer)

    def engine_request(self, prompt_ids: list[int]) -> GenerationRequest | None:
        """What to ask the engine for (job_request.py); None when nothing is left to generate."""
        self.prompt_tokens = len(prompt_ids)
        done = self.progress.token_ids
        return job_request.engine_request(
            self.spec,
            prompt_ids,
            done,
            self._engine,
            replay=self._replay,
            cancelled=self._cancelled,
            owner=self.claim.owner,
            weight=self.weight,
        )

    def attach(self, stream: GenerationStream) -> None:
        self._stream = stream

    async def run(self) -> None:
        publisher = self._writer.publisher(self.job_id, self.claim.attempt, len(self.progress.token_ids))
        resumed_from = len(self.progress.token_ids)
        publisher.add(*running_writes(self.claim, self.worker_id, self.prompt_tokens, resumed_from))
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
        if self._preempting and not self._cancelled and outcome.status is JobStatus.cancelled:
            self.preempted = True
            return
        if not self._abandoned and not self.lost:
            await self._finish(outcome, publisher)

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
        sampling = self.spec.sampling
        own_stops = not self._engine.handles_stop_strings or sampling.include_stop_str_in_output
        matcher = (
            StopMatcher(sampling.stop, keep_stop=sampling.include_stop_str_in_output)
            if own_stops and sampling.stop
            else None
        )
        decoding = _Decoding(decoder, matcher, frozenset(sampling.stop_token_ids or ()), [self.progress.text])
        decoding.generated = done_before
        outcome: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()

        def take(update: EngineUpdate) -> None:
            if outcome.done():
                return
            try:
                ended = self._take(update, decoding, publisher)
            except Exception as e:  # a fault of this process: the job fails, the other jobs go on
                outcome.set_exception(e)
                return
            if ended is not None:
                outcome.set_result(ended)

        # Each engine step's tokens are handled in the wake-up that delivers them, for all jobs at once.
        self._stream.updates.consume(take)
        return await outcome

    def _take(self, update: EngineUpdate, decoding: _Decoding, publisher: StreamPublisher) -> Outcome | None:
        """Handles one engine update: its text goes to the publisher. Returns the outcome once the
        engine is done with the job."""
        assert self._stream is not None
        if publisher.lost and not self._stream.cancel_requested:
            # Another attempt owns the job, or its record is gone: nothing this one makes is written,
            # so its engine slot is freed now rather than when the generation would have ended.
            self._engine.cancel(self._stream)
        if decoding.stopped:  # what the engine made after the stop, until it stopped, is dropped
            return self._stopped(decoding) if update.finish is not None else None
        if update.batch_rows > self.batch_peak:
            self.batch_peak = update.batch_rows
        if update.cached_tokens is not None:
            self.cached_tokens = update.cached_tokens
        if update.prompt_logprobs is not None and not self.progress.token_ids and decoding.generated == 0:
            # once per job: an attempt that resumes after tokens were written does not write it again
            assert self._logprob_entries is not None and self._stream is not None
            prompt = self._stream.request.prompt_ids
            publisher.add(prompt_entry(prompt, self._logprob_entries.prompt(prompt, update.prompt_logprobs)))
        token_ids = update.token_ids
        if (
            len(token_ids) == 1
            and decoding.matcher is None
            and update.logprobs is None
            and update.replay_exact is None
            and self.progress.first_token_at is not None
            and token_ids[0] not in decoding.stop_ids
        ):
            # The common update: one token, no stop string to match, nothing for the job's record. What
            # the general path below does for it, without its lists and joins.
            piece = decoding.decoder.decode(token_ids[0])
            index = decoding.generated
            decoding.generated = index + 1
            self._token_times.append(time.time())
            self.tokens_generated += 1
            publisher.add_tokens(piece, token_ids, index)
            decoding.pieces.append(piece)
            return None if update.finish is None else self._outcome(update, decoding.text, index + 1)
        pieces = []
        hit_stop = False
        generated = index = decoding.generated  # index: of this step's first token
        matcher = decoding.matcher
        for token in update.token_ids:
            generated += 1
            if token in decoding.stop_ids:  # vLLM's stop_token_ids: ends the text like end of sequence
                pieces.append("")
                hit_stop = True
                break
            piece = decoding.decoder.decode(token)
            if matcher is not None:
                piece, hit_stop = matcher.feed(piece)
            pieces.append(piece)
            if hit_stop:
                break
        decoding.generated = generated
        if update.token_ids:
            now = time.time()
            self._token_times.append(now)
            self.tokens_generated += len(update.token_ids)
            chunk = "".join(pieces)
            record = None
            if self.progress.first_token_at is None:
                self.progress.first_token_at = now
                record = RecordUpdate(first_token_at=now).to_fields()
            if update.replay_exact is not None:
                record = {**(record or {}), **RecordUpdate(resume_exact=update.replay_exact).to_fields()}
            kept = update.token_ids[: len(pieces)]
            logprobs = None
            if self._logprob_entries is not None and update.logprobs is not None:
                logprobs = self._logprob_entries(kept, update.logprobs)
            publisher.add_tokens(chunk, kept, index, logprobs, record)
            decoding.pieces.append(chunk)
        if hit_stop:
            decoding.stopped = True
            if update.finish is not None:  # the stop came with the engine's last update
                return self._stopped(decoding)
            self._engine.cancel(self._stream)
            return None
        if update.finish is None:
            return None
        if matcher is not None:
            tail = matcher.flush()
            if tail:
                publisher.add_tokens(tail, [], generated)
                decoding.pieces.append(tail)
        return self._outcome(update, decoding.text, generated)

    @staticmethod
    def _stopped(decoding: _Decoding) -> Outcome:
        return Outcome(JobStatus.succeeded, FinishReason.stop, decoding.text, decoding.generated)

    def _outcome(self, update: EngineUpdate, text: str, generated: int) -> Outcome:
        finish = update.finish
        if finish is Finish.cancelled or (self._cancelled and finish is not Finish.error):
            return Outcome(JobStatus.cancelled, FinishReason.cancelled, text, generated)
        if finish is Finish.lost:
            self.lost = True  # its streamed tokens are written; the next attempt resumes from them
            return Outcome(JobStatus.queued, None, text, generated)
        if finish is Finish.error:
            code = update.error_code or ErrorCode.job_failed  # the engine's failure, unless it named one
            return Outcome(JobStatus.failed, FinishReason.error, text, generated, update.error, code)
        closed = update.closed_early
        reason = FinishReason.length if finish is Finish.length else FinishReason.stop
        return Outcome(JobStatus.succeeded, reason, text, generated, closed_early=closed)

    async def _finish(self, outcome: Outcome, publisher: StreamPublisher) -> None:
        record, final = final_writes(
            outcome,
            submitted_at=self.spec.submitted_at,
            started_at=self.started_at,
            first_token_at=self.progress.first_token_at,
            token_times=self._token_times,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            batch_peak=self.batch_peak,
            now=time.time(),
        )
        await write_final(self._queue, self.claim, record, final, publisher, self.spec.priority)
        self.outcome = outcome
        spec = self.spec
        if spec.messages and 0 < self._engine.prefix_block_tokens <= self.prompt_tokens:
            try:  # only a hint: a job that does not find it prefills its prompt again
                await self._queue.leave_prefix_hints(
                    spec.model, spec.cache_scope, spec.messages, self.worker_id
                )
            except RedisError as e:
                logger.warning("job %s: its prefix hints were not written (%s)", self.job_id, e)
