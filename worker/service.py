"""The worker's job loop: claim jobs while engine slots are free, run them, keep leases alive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys
from common.jobqueue import Claim, JobQueue, MalformedJob, parse_job_payload
from common.registry import WorkerInfo, deregister, heartbeat
from common.settings import WorkerSettings
from worker.engine import Engine, GenerationRequest, Tokenizer
from worker.job_runner import JobRun, PromptTooLong
from worker.throughput import Throughput

logger = logging.getLogger(__name__)


class WorkerService:
    def __init__(
        self,
        settings: WorkerSettings,
        redis: Redis,
        engine: Engine,
        tokenizer: Tokenizer,
        info: WorkerInfo,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.queue = JobQueue(redis, settings.job_ttl_s)
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = info
        self.runs: dict[str, JobRun] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._last_batch = 0  # jobs in the last static batch
        self._batch_ended_at = 0.0  # when the worker last ran out of jobs
        self._stopping = asyncio.Event()
        self.on_job_done: Callable[[JobRun], Awaitable[None] | None] | None = None
        # A job that failed without an outcome of its run (malformed, too many attempts, a worker error).
        self.on_job_failed: Callable[[Claim, str], Awaitable[None] | None] | None = None
        self._finished_tokens = 0
        self._throughput = Throughput(time.monotonic())

    @property
    def model(self) -> str:
        return self.info.model

    def free_slots(self) -> int:
        busy = sum(1 for run in self.runs.values() if not run.engine_done)
        if self.engine.continuous_batching:
            return self.engine.capacity - busy
        # The static scheduler runs a batch to its end before it admits anyone: claim only between batches.
        return 0 if busy else self.engine.capacity

    def _engine_released(self) -> None:
        if all(run.engine_done for run in self.runs.values()):
            self._batch_ended_at = time.time()
        self._slot_freed.set()

    async def warm_up(self) -> int:
        """Runs one full batch and returns how many requests the engine really generated together."""
        prompt = self.tokenizer.encode("Hello")
        streams = self.engine.submit([GenerationRequest(prompt, max_new_tokens=2)] * self.engine.capacity)
        widest = 0
        for stream in streams:
            while True:
                update = await stream.updates.get()
                widest = max(widest, update.batch_rows)
                if update.finish is not None:
                    break
        return widest

    async def run(self) -> None:
        lease = self.settings.heartbeat_ttl_s
        await heartbeat(self.redis, self.info, lease, self.settings.job_ttl_s)
        background = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._listen(), name="listen"),
        ]
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            with contextlib.suppress(RedisError):
                await deregister(self.redis, self.info.id)

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
            try:
                claims = await self.queue.claim(
                    self.model, self.info.id, slots, self.settings.heartbeat_ttl_s
                )
            except RedisError as e:
                logger.warning("claiming jobs failed (%s); retrying", e)
                await asyncio.sleep(0.5)
                continue
            if claims:
                if not self.engine.continuous_batching:
                    if len(claims) < slots:
                        claims += await self._fill_static_batch(claims, slots)
                    self._last_batch = len(claims)
                await self._start(claims)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.claim_poll_s)

    def _static_target(self, claims: list[Claim], slots: int) -> int:
        """How many jobs to gather before a static batch starts (it admits no one until it ends): as
        many as the last batch had, since its clients tend to come back, plus the claimed jobs that
        were submitted while it ran (they could not join it, and would otherwise run one by one)."""
        missed = sum(1 for claim in claims if _submitted_at(claim) < self._batch_ended_at)
        return min(slots, max(len(claims), self._last_batch + missed))

    async def _fill_static_batch(self, claims: list[Claim], slots: int) -> list[Claim]:
        """More jobs for a static batch, claimed as they are submitted: those it expects, for up to
        static_batch_window_s; otherwise a tenth of that, for jobs submitted together with the first."""
        loop = asyncio.get_running_loop()
        room, target = slots - len(claims), self._static_target(claims, slots)
        window = self.settings.static_batch_window_s
        deadline = loop.time() + (window if target > len(claims) else window / 10)
        enough = target - len(claims) if target > len(claims) else room
        more: list[Claim] = []
        while len(more) < enough and (left := deadline - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)
            self._wake.clear()  # before claiming: a job submitted meanwhile wakes the next round
            try:
                more += await self.queue.claim(
                    self.model, self.info.id, room - len(more), self.settings.heartbeat_ttl_s
                )
            except RedisError as e:
                logger.warning("claiming jobs failed (%s)", e)
                break
        return more

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
            try:
                request = run.engine_request(run.prompt_ids())
            except PromptTooLong as e:
                self._spawn(self._fail(run.claim, run.spec.model, str(e), e.code))
                del self.runs[run.job_id]
                continue
            started.append(run)
            if request is not None:
                requests.append(request)
                generating.append(run)
        if requests:
            for run, stream in zip(generating, self.engine.submit(requests), strict=True):
                run.attach(stream)
        for run in started:
            self._spawn(self._execute(run))

    async def _prepare(self, claim: Claim) -> JobRun | None:
        try:
            spec = parse_job_payload(claim.payload)
        except MalformedJob as e:
            logger.error("job %s: %s", claim.job_id, e)
            await self._fail(claim, self.model, f"{e}; the job cannot run")
            return None
        if claim.attempt > self.settings.max_attempts:
            message = (
                f"the job was started {claim.attempt - 1} times and each time its worker stopped "
                f"before it finished; giving up after {self.settings.max_attempts} attempts"
            )
            await self._fail(claim, spec.model, message)
            return None
        run = JobRun(
            claim,
            spec,
            queue=self.queue,
            engine=self.engine,
            tokenizer=self.tokenizer,
            publish_max_batch=self.settings.publish_max_batch,
            worker_id=self.info.id,
        )
        run.on_engine_done = self._engine_released
        self.runs[claim.job_id] = run
        return run

    async def _fail(self, claim: Claim, model: str, message: str, code: str | None = None) -> None:
        fields = {"finish_reason": "error"}
        failed = await self.queue.fail(claim.job_id, model, claim.attempt, message, fields, code)
        if failed and self.on_job_failed is not None:
            result = self.on_job_failed(claim, model)
            if result is not None:
                await result

    async def _execute(self, run: JobRun) -> None:
        try:
            await run.run()
        except Exception:
            logger.exception("job %s failed in the worker", run.job_id)
            with contextlib.suppress(RedisError):
                await self._fail(run.claim, run.spec.model, "the worker failed while running the job")
        finally:
            self._finished_tokens += run.tokens_generated
            self.runs.pop(run.job_id, None)
            if run.engine_done:
                self._slot_freed.set()  # its slot was freed already; a draining worker counts runs
            else:
                self._engine_released()
        if self.on_job_done is not None:
            result = self.on_job_done(run)
            if result is not None:
                await result

    def generated_tokens(self) -> int:
        """Tokens this worker generated since it started, running jobs included."""
        return self._finished_tokens + sum(run.tokens_generated for run in self.runs.values())

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _heartbeat_loop(self) -> None:
        ttl = self.settings.heartbeat_ttl_s
        while True:
            await asyncio.sleep(ttl / 4)
            self.info.in_flight = len(self.runs)
            self.info.generated_tokens = self.generated_tokens()
            self.info.tokens_per_s = round(
                self._throughput.update(self.info.generated_tokens, time.monotonic()), 2
            )
            try:
                await heartbeat(self.redis, self.info, ttl, self.settings.job_ttl_s)
                await self.queue.renew_leases(self.model, list(self.runs), ttl)
            except RedisError as e:
                logger.warning("heartbeat failed (%s)", e)

    async def _listen(self) -> None:
        wake = keys.wake_channel(self.model)
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(wake, keys.CANCEL_CHANNEL)
                self._wake.set()  # jobs may have arrived while not subscribed
                async for message in pubsub.listen():
                    if message["channel"] == wake:
                        self._wake.set()
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), deadline - time.monotonic())
        for job_id, run in list(self.runs.items()):
            run.abandon()
            await self.queue.release(self.model, job_id)
            logger.info("job %s handed back to the queue", job_id)


def _submitted_at(claim: Claim) -> float:
    try:
        return parse_job_payload(claim.payload).submitted_at
    except MalformedJob:
        return 0.0
