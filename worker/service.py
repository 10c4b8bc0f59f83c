"""The worker's job loop: claim jobs while engine slots are free, start them and see them end, get a new
engine after a failure, drain on stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.aio import wait_set
from common.error_codes import ErrorCode
from common.jobs.claims import Claim
from common.jobs.payload import MalformedJob, parse_job_payload
from common.jobs.queue import JobQueue
from common.keys import Keyspace
from common.registry import WorkerInfo
from common.worker_settings import WorkerSettings
from worker.engine import Engine, EngineUpdate, Finish, GenerationRequest, Tokenizer
from worker.heartbeat import Heartbeat
from worker.job_request import GuidedResume, NeedsLogits, PromptTooLong
from worker.job_runner import JobRun
from worker.preemption import Preemption
from worker.publisher import StepWriter
from worker.static_batch import StaticBatches

logger = logging.getLogger(__name__)


class EngineUnrecoverable(RuntimeError):
    """The engine failed and no new one could be made in this process."""


WARM_UP_PROMPT = "Hello"
WARM_UP_TOKENS = 2


class WarmUpFailed(Exception):
    """The engine's warm-up gave no text: a greedy generation that ends in nothing (weights that load but
    compute NaN answer every request with an empty string)."""


class WorkerService:
    def __init__(
        self,
        settings: WorkerSettings,
        redis: Redis,
        engine: Engine,
        tokenizer: Tokenizer,
        info: WorkerInfo,
        keys: Keyspace,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = keys  # its store's keyspace on that Redis
        self.queue = JobQueue(redis, settings.job_ttl_s, keys)
        self.writer = StepWriter(
            self.queue,
            settings.publish_max_batch,
            settings.stream_interval,
            max_wait_s=settings.stream_coalesce_ms / 1000,
            writes_per_s=settings.stream_writes_per_s,
        )
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = info
        self.runs: dict[str, JobRun] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self.heartbeat = Heartbeat(settings, redis, self.queue, info, self.runs)
        self.preemption = Preemption(settings, self.queue, engine, info.model, self.runs, self.free_slots)
        self.static_batches = StaticBatches(settings, self.queue, info.model, info.id, self._wake)
        self._suspect_waiting = False  # a suspect job waits for this worker to run nothing else
        self.on_job_done: Callable[[JobRun], None] | None = None
        # A job that failed without an outcome of its run (malformed, too many attempts, a worker error).
        self.on_job_failed: Callable[[], None] | None = None
        self.on_adapter_loaded: Callable[[str], None] | None = None  # a LoRA adapter loaded at run time
        self.preemptions = 0
        self.engine_restarts = 0  # failed engines replaced by a working one
        self._recovery: asyncio.Task[None] | None = None  # while the engine is rebuilt after a failure
        self.unrecoverable: BaseException | None = None  # why the engine could not be rebuilt
        self._failed_again: str | None = None
        engine.on_failure = self._engine_failed

    @property
    def model(self) -> str:
        return self.info.model

    def free_slots(self) -> int:
        if self._recovery is not None:
            return 0  # no engine to run them
        busy = sum(1 for run in self.runs.values() if not run.engine_done)
        if any(run.claim.quarantined for run in self.runs.values()):
            return 0  # a quarantined job runs alone until it ends
        if self._suspect_waiting and busy:
            return 0  # take no more, so that the worker runs nothing else and can take the suspect
        if self.engine.continuous_batching:
            return self.engine.capacity - busy
        # The static scheduler runs a batch to its end before it admits anyone: claim only between batches.
        return 0 if busy else self.engine.capacity

    def _engine_released(self) -> None:
        if all(run.engine_done for run in self.runs.values()):
            self.static_batches.all_ended()
        self._slot_freed.set()

    async def warm_up(self) -> int:
        """Runs one full batch of short greedy generations and returns how many requests the engine really
        generated together; WarmUpFailed when the first gives no text, or log-probabilities that are not
        numbers (weights that hold NaN)."""
        prompt = self.tokenizer.encode(WARM_UP_PROMPT)
        logprobs = 0 if self.engine.exposes_logits else None
        request = GenerationRequest(
            prompt, max_new_tokens=WARM_UP_TOKENS, min_new_tokens=WARM_UP_TOKENS, logprobs=logprobs
        )
        streams = self.engine.submit([request] * self.engine.capacity)
        widest = 0
        first: list[EngineUpdate] = []
        for row, stream in enumerate(streams):
            while True:
                update = await stream.updates.get()
                widest = max(widest, update.batch_rows)
                if row == 0:
                    first.append(update)
                if update.finish is not None:
                    break
        problem = self._warm_up_problem(first)
        if problem is not None:
            raise WarmUpFailed(
                f"a greedy generation of {WARM_UP_TOKENS} tokens after {WARM_UP_PROMPT!r} {problem}"
            )
        return widest

    def _warm_up_problem(self, updates: list[EngineUpdate]) -> str | None:
        ids = [token for update in updates for token in update.token_ids]
        last = updates[-1]
        if last.finish is Finish.error:
            return f"failed ({last.error})"
        logprobs = [entry.logprob for update in updates for entry in update.logprobs or ()]
        if not all(math.isfinite(logprob) for logprob in logprobs):
            return f"gave token ids {ids} with log-probabilities {logprobs}, which are no numbers"
        if not self.tokenizer.decode(ids):
            return f"gave token ids {ids}, which are no text"
        return None

    async def run(self) -> None:
        await self.heartbeat.register()
        beating = asyncio.create_task(self.heartbeat.run(), name="heartbeat")
        background = [asyncio.create_task(self._listen(), name="listen")]
        if self.settings.preempt_batch:
            background.append(asyncio.create_task(self.preemption.run(), name="preempt"))
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.writer.close()
            await self.heartbeat.leave(beating)
        if self.unrecoverable is not None:
            raise EngineUnrecoverable(
                f"the engine failed and no new one could be made ({self.unrecoverable}); the worker stops "
                "so that its supervisor starts it again"
            ) from self.unrecoverable

    def _engine_failed(self, cause: str) -> None:
        if self._recovery is not None:
            self._failed_again = cause  # the new engine failed too, before it served
        elif not self._stopping.is_set():
            self._failed_again = None
            self._recovery = asyncio.create_task(self._recover(cause), name="engine-recovery")

    async def _recover(self, cause: str) -> None:
        """After the engine failed for good: out of the ready workers at once, the jobs it held back in
        the queue (their runs end `lost`; see _execute), then a new engine in this process. A worker
        whose engine cannot be made again stops, and exits nonzero for its supervisor to restart it."""
        logger.error("the engine failed (%s): the worker takes no job until it has a new one", cause)
        self.info.state = "recovering"
        await self.heartbeat.beat_now()
        while any(not run.engine_done for run in self.runs.values()):
            self._slot_freed.clear()
            await self._slot_freed.wait()
        try:
            await self.engine.restart()
            await self.warm_up()
            if self._failed_again is not None:
                raise RuntimeError(f"the new engine failed too ({self._failed_again})")
        except Exception as e:
            logger.critical("no new engine could be made (%s): the worker stops", e)
            self.unrecoverable = e
            self.stop()
            return
        self.engine_restarts += 1
        self.info.state = "ready"
        self._recovery = None
        await self.heartbeat.beat_now()
        logger.info("the worker serves again on a new engine (%d restarts)", self.engine_restarts)
        self._slot_freed.set()
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._slot_freed.set()

    async def _claim_loop(self) -> None:
        while not self._stopping.is_set():
            slots = self.free_slots()
            if slots <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            self._wake.clear()
            idle = all(run.engine_done for run in self.runs.values())
            try:
                claimed = await self.queue.claim_jobs(
                    self.model,
                    self.info.id,
                    slots,
                    self.settings.heartbeat_ttl_s,
                    idle=idle,
                    kv_budget_tokens=self.info.kv_budget_tokens,
                    promised=self.preemption.take_promised(),
                )
            except RedisError as e:
                logger.warning("claiming jobs failed (%s); retrying", e)
                await asyncio.sleep(0.5)
                continue
            claims = claimed.claims
            self._suspect_waiting = claimed.suspect_waiting
            if claims:
                quarantined = any(claim.quarantined for claim in claims)
                if not self.engine.continuous_batching and not quarantined:
                    claims = await self.static_batches.gather(claims, slots)
                await self._start(claims)
                continue
            await wait_set(self._wake, self.settings.claim_poll_s)

    async def _start(self, claims: list[Claim]) -> None:
        runs: list[JobRun] = []
        for claim in claims:
            run = await self._prepare(claim)
            if run is not None:
                runs.append(run)
        await asyncio.gather(*(run.load_progress() for run in runs))
        started: list[JobRun] = []
        requests: list[GenerationRequest] = []
        generating: list[JobRun] = []
        for run in runs:
            if holds_marker(self.settings.fail_marker, run):
                message = "the job failed on its worker (its prompt holds the fail marker, a testing aid)"
                self._refuse(run, message, ErrorCode.job_failed)
                continue
            try:
                request = run.engine_request(run.prompt_ids())
            except (PromptTooLong, GuidedResume, NeedsLogits) as e:
                self._refuse(run, str(e), e.code)
                continue
            except Exception as e:  # the job's content broke the tokenizer or the chat template
                logger.warning("job %s: its prompt could not be prepared (%s)", run.job_id, type(e).__name__)
                self._refuse(
                    run, f"the prompt could not be prepared for the model: {e}", ErrorCode.invalid_prompt
                )
                continue
            started.append(run)
            if request is not None:
                requests.append(request)
                generating.append(run)
        if requests:
            try:
                streams = self.engine.submit(requests)
            except Exception as e:  # a request the engine refused: fail these jobs, keep the worker
                logger.exception("the engine refused %d job(s)", len(requests))
                for run in generating:
                    self._refuse(run, f"the engine could not start the job: {e}", ErrorCode.invalid_prompt)
                    started.remove(run)
                self._engine_released()
                streams = []
                generating = []
            for run, stream in zip(generating, streams, strict=True):
                run.attach(stream)
        crash_on_marker(self.settings.crash_marker, generating)
        for run in started:
            self._spawn(self._execute(run))

    def _refuse(self, run: JobRun, message: str, code: ErrorCode) -> None:
        """The job fails before its run starts, and leaves this worker."""
        self._spawn(self._fail(run.claim, message, code))
        self.runs.pop(run.job_id, None)

    async def _prepare(self, claim: Claim) -> JobRun | None:
        try:
            spec = parse_job_payload(claim.payload)
        except MalformedJob as e:
            logger.error("job %s: %s", claim.job_id, e)
            await self._fail(claim, f"{e}; the job cannot run")
            return None
        if claim.quarantine_deaths >= self.settings.max_attempts:
            await self._fail(claim, poison_message(claim.quarantine_deaths), ErrorCode.poison)
            return None
        run = JobRun(
            claim,
            spec,
            queue=self.queue,
            engine=self.engine,
            tokenizer=self.tokenizer,
            writer=self.writer,
            worker_id=self.info.id,
            replay=self.settings.resume_mode == "replay",
        )
        run.on_engine_done = self._engine_released
        self.runs[claim.job_id] = run
        return run

    async def _fail(self, claim: Claim, message: str, code: ErrorCode | None = None) -> None:
        failed = await self.queue.fail(claim, message, code)
        if failed and self.on_job_failed is not None:
            self.on_job_failed()

    async def _execute(self, run: JobRun) -> None:
        try:
            await run.run()
            if run.preempted and await self.queue.release(run.claim, preempted=True):
                self.preemptions += 1
            elif run.lost and not run.preempted and await self.queue.release(run.claim):
                logger.info("job %s handed back to the queue: the engine failed under it", run.job_id)
            if run.preempt_requested:
                with contextlib.suppress(RedisError):
                    await self.queue.end_preemption(self.model, self.settings.heartbeat_ttl_s)
        except Exception:
            logger.exception("job %s failed in the worker", run.job_id)
            with contextlib.suppress(RedisError):
                await self._fail(run.claim, "the worker failed while running the job")
        finally:
            self.heartbeat.count_finished(run)
            self.runs.pop(run.job_id, None)
            if run.engine_done:
                self._slot_freed.set()  # its slot was freed already; a draining worker counts runs
            else:
                self._engine_released()
        if self.on_job_done is not None:
            self.on_job_done(run)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _listen(self) -> None:
        wake = self.keys.wake_channel(self.model)
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(wake, self.keys.cancel_channel)
                self._wake.set()  # jobs may have arrived while not subscribed
                async for message in pubsub.listen():
                    if message["channel"] == wake:
                        self._wake.set()
                        self.preemption.job_submitted()
                    else:
                        run = self.runs.get(message["data"])
                        if run is not None:
                            run.cancel()
            except RedisError as e:
                logger.warning("lost the Redis subscription (%s); resubscribing", e)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _drain(self) -> None:
        """On stop: let running jobs finish within the grace period, then hand the rest back."""
        self.info.state = "draining"
        deadline = time.monotonic() + self.settings.shutdown_grace_s
        while self.runs and time.monotonic() < deadline:
            self._slot_freed.clear()
            await wait_set(self._slot_freed, deadline - time.monotonic())
        for job_id, run in list(self.runs.items()):
            run.abandon()
            if await self.queue.release(run.claim):
                logger.info("job %s handed back to the queue", job_id)


def poison_message(deaths: int) -> str:
    return (
        f"the job failed as poison: its worker died {deaths} times while the job ran alone on it, in "
        f"quarantine (after an earlier worker death); giving up after {deaths} quarantined attempts "
        "(ORTFLEET_MAX_ATTEMPTS)"
    )


def crash_on_marker(marker: str, runs: list[JobRun]) -> None:
    """Testing aid: the worker dies at once, as an engine crash would, once it runs a job whose
    prompt holds the marker (the jobs batched with it die with it)."""
    for run in runs:
        if holds_marker(marker, run):
            logger.error("job %s holds the crash marker: the worker dies (a testing aid)", run.job_id)
            os.kill(os.getpid(), signal.SIGKILL)


def holds_marker(marker: str, run: JobRun) -> bool:
    """Whether the job's prompt (or a chat message of it) holds a testing aid's marker; never for ''."""
    if not marker:
        return False
    spec = run.spec
    return marker in (spec.prompt or "".join(m.model_dump_json() for m in spec.messages or []))
