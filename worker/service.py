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
        self._stopping = asyncio.Event()
        self.on_job_done: Callable[[JobRun], Awaitable[None] | None] | None = None

    @property
    def model(self) -> str:
        return self.info.model

    def free_slots(self) -> int:
        if self.engine.continuous_batching:
            return self.engine.capacity - len(self.runs)
        # The static scheduler runs a batch to its end before it admits anyone: claim only between batches.
        return 0 if self.runs else self.engine.capacity

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
                await self._start(claims)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.claim_poll_s)

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
                self._spawn(self._fail(run.claim, run.spec.model, str(e)))
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
        self.runs[claim.job_id] = run
        return run

    async def _fail(self, claim: Claim, model: str, message: str) -> None:
        await self.queue.fail(claim.job_id, model, claim.attempt, message, {"finish_reason": "error"})

    async def _execute(self, run: JobRun) -> None:
        try:
            await run.run()
        except Exception:
            logger.exception("job %s failed in the worker", run.job_id)
            with contextlib.suppress(RedisError):
                await self._fail(run.claim, run.spec.model, "the worker failed while running the job")
        finally:
            self.runs.pop(run.job_id, None)
            self._slot_freed.set()
        if self.on_job_done is not None:
            result = self.on_job_done(run)
            if result is not None:
                await result

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _heartbeat_loop(self) -> None:
        ttl = self.settings.heartbeat_ttl_s
        while True:
            await asyncio.sleep(ttl / 4)
            self.info.in_flight = len(self.runs)
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
