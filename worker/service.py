"""The worker's job loop: claim jobs while engine slots are free, run them, keep leases alive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys
from common.aio import wait_set
from common.error_codes import ErrorCode
from common.jobs.claims import Claim
from common.jobs.payload import MalformedJob, parse_job_payload
from common.jobs.queue import JobQueue
from common.registry import WorkerInfo, deregister, heartbeat
from common.settings import WorkerSettings
from common.wire import PriorityClass
from worker.engine import Engine, GenerationRequest, Tokenizer
from worker.job_runner import GuidedResume, JobRun, NeedsLogits, PromptTooLong
from worker.publisher import StepWriter
from worker.throughput import Throughput

logger = logging.getLogger(__name__)


class EngineUnrecoverable(RuntimeError):
    """The engine failed and no new one could be made in this process."""


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
        self.writer = StepWriter(self.queue, settings.publish_max_batch, settings.stream_interval)
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = info
        self.runs: dict[str, JobRun] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._interactive_wake = asyncio.Event()  # a job was submitted: maybe batch work must yield
        self._slot_freed = asyncio.Event()
        self._last_batch = 0  # jobs in the last static batch
        self._batch_ended_at = 0.0  # when the worker last ran out of jobs
        self._stopping = asyncio.Event()
        self._leaving = asyncio.Event()  # drained: the heartbeat ends, then the entry is removed
        self._suspect_waiting = False  # a suspect job waits for this worker to run nothing else
        self.on_job_done: Callable[[JobRun], Awaitable[None] | None] | None = None
        # A job that failed without an outcome of its run (malformed, too many attempts, a worker error).
        self.on_job_failed: Callable[[Claim, str], Awaitable[None] | None] | None = None
        self.preemptions = 0
        self.engine_restarts = 0  # failed engines replaced by a working one
        self._recovery: asyncio.Task[None] | None = None  # while the engine is rebuilt after a failure
        self.unrecoverable: BaseException | None = None  # why the engine could not be rebuilt
        self._failed_again: str | None = None
        engine.on_failure = self._engine_failed
        self._finished_tokens = 0
        self._finished_prompt_tokens = 0
        self._throughput = Throughput(time.monotonic())
        self._busy_s = 0.0  # a clock that runs only while the worker runs jobs: its speed's time base
        self._speed = Throughput(0.0)
        self._speed_sampled = (time.monotonic(), 0)  # when, and the tokens it had processed then

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
        beating = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        background = [asyncio.create_task(self._listen(), name="listen")]
        if self.settings.preempt_batch:
            background.append(asyncio.create_task(self._preempt_loop(), name="preempt"))
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.writer.close()
            await self._leave(beating)
        if self.unrecoverable is not None:
            raise EngineUnrecoverable(
                f"the engine failed and no new one could be made ({self.unrecoverable}); the worker stops "
                "so that its supervisor starts it again"
            ) from self.unrecoverable

    async def _leave(self, beating: asyncio.Task[None]) -> None:
        """Out of the registry. The heartbeat ends first, a beat in flight included (it is bounded by its
        own timeout), so that no beat lands after the entry is removed and makes it live again."""
        self._leaving.set()
        with contextlib.suppress(Exception):  # its errors were logged as they came
            await asyncio.wait_for(asyncio.shield(beating), self.settings.heartbeat_ttl_s)
        beating.cancel()
        try:
            await deregister(self.redis, self.info.id)
        except RedisError as e:
            logger.warning(
                "leaving the registry failed (%s): the worker counts as live until its heartbeat runs out, "
                "in %.0f s",
                e,
                self.settings.heartbeat_ttl_s,
            )

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
        await self._beat_now()
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
        await self._beat_now()
        logger.info("the worker serves again on a new engine (%d restarts)", self.engine_restarts)
        self._slot_freed.set()
        self._wake.set()

    async def _beat_now(self) -> None:
        """The registry entry, with the worker's state, written now rather than at the next beat."""
        try:
            await asyncio.wait_for(
                self._beat(self.settings.heartbeat_ttl_s), self.settings.heartbeat_ttl_s / 2
            )
        except (RedisError, TimeoutError) as e:
            logger.warning("heartbeat failed (%s)", e or "Redis did not answer in time")

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
                    self.model, self.info.id, slots, self.settings.heartbeat_ttl_s, idle=idle
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
                    if len(claims) < slots:
                        claims += await self._fill_static_batch(claims, slots)
                    self._last_batch = len(claims)
                await self._start(claims)
                continue
            await wait_set(self._wake, self.settings.claim_poll_s)

    def _static_target(self, claims: list[Claim], slots: int) -> int:
        """How many jobs to gather before a static batch starts (it admits no one until it ends): as
        many as the last batch had, since its clients tend to come back, plus the claimed jobs that
        were submitted while it ran (they could not join it, and would otherwise run one by one)."""
        missed = sum(1 for claim in claims if _submitted_at(claim) < self._batch_ended_at)
        return min(slots, max(len(claims), self._last_batch + missed))

    async def _fill_static_batch(self, claims: list[Claim], slots: int) -> list[Claim]:
        """More jobs for a static batch, claimed as they are submitted: those it expects, for up to
        static_batch_window_s; otherwise the rest of a tenth of that after the first job's submission,
        for jobs submitted together with it. A wait that ends with no job submitted claims nothing."""
        loop = asyncio.get_running_loop()
        room, target = slots - len(claims), self._static_target(claims, slots)
        window = self.settings.static_batch_window_s
        expecting = target > len(claims)
        deadline = loop.time() + (window if expecting else together_window(window, claims, time.time()))
        enough = target - len(claims) if expecting else room
        more: list[Claim] = []
        while len(more) < enough and (left := deadline - loop.time()) > 0:
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                break  # no job was submitted meanwhile: none to claim
            self._wake.clear()  # before claiming: a job submitted meanwhile wakes the next round
            try:
                more += await self.queue.claim(
                    self.model, self.info.id, room - len(more), self.settings.heartbeat_ttl_s, idle=False
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
            if holds_marker(self.settings.fail_marker, run):
                message = "the job failed on its worker (its prompt holds the fail marker, a testing aid)"
                self._spawn(self._fail(run.claim, run.spec.model, message, ErrorCode.job_failed))
                del self.runs[run.job_id]
                continue
            try:
                request = run.engine_request(run.prompt_ids())
            except (PromptTooLong, GuidedResume, NeedsLogits) as e:
                self._spawn(self._fail(run.claim, run.spec.model, str(e), e.code))
                del self.runs[run.job_id]
                continue
            except Exception as e:  # the job's content broke the tokenizer or the chat template
                logger.warning("job %s: its prompt could not be prepared (%s)", run.job_id, type(e).__name__)
                message = f"the prompt could not be prepared for the model: {e}"
                self._spawn(self._fail(run.claim, run.spec.model, message, ErrorCode.invalid_prompt))
                del self.runs[run.job_id]
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
                    message = f"the engine could not start the job: {e}"
                    self._spawn(self._fail(run.claim, run.spec.model, message, ErrorCode.invalid_prompt))
                    self.runs.pop(run.job_id, None)
                    started.remove(run)
                self._engine_released()
                streams = []
                generating = []
            for run, stream in zip(generating, streams, strict=True):
                run.attach(stream)
        crash_on_marker(self.settings.crash_marker, generating)
        for run in started:
            self._spawn(self._execute(run))

    async def _prepare(self, claim: Claim) -> JobRun | None:
        try:
            spec = parse_job_payload(claim.payload)
        except MalformedJob as e:
            logger.error("job %s: %s", claim.job_id, e)
            await self._fail(claim, self.model, f"{e}; the job cannot run")
            return None
        if claim.quarantine_deaths >= self.settings.max_attempts:
            await self._fail(claim, spec.model, poison_message(claim.quarantine_deaths), ErrorCode.poison)
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

    async def _fail(self, claim: Claim, model: str, message: str, code: ErrorCode | None = None) -> None:
        failed = await self.queue.fail(claim, message, code)
        if failed and self.on_job_failed is not None:
            result = self.on_job_failed(claim, model)
            if result is not None:
                await result

    async def _execute(self, run: JobRun) -> None:
        try:
            await run.run()
            if run.preempted and await self.queue.release(run.claim, preempted=True, behind=run.behind):
                self.preemptions += 1
            elif run.lost and not run.preempted and await self.queue.release(run.claim):
                logger.info("job %s handed back to the queue: the engine failed under it", run.job_id)
            if run.preempt_requested:
                with contextlib.suppress(RedisError):
                    await self.queue.end_preemption(self.model, self.settings.heartbeat_ttl_s)
        except Exception:
            logger.exception("job %s failed in the worker", run.job_id)
            with contextlib.suppress(RedisError):
                await self._fail(run.claim, run.spec.model, "the worker failed while running the job")
        finally:
            self._finished_tokens += run.tokens_generated
            self._finished_prompt_tokens += run.prompt_tokens
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

    def processed_tokens(self) -> int:
        """Prompt and generated tokens of every job this worker ran since it started, running jobs included
        (a prompt counts once its job has it tokenized)."""
        running = sum(run.prompt_tokens + run.tokens_generated for run in self.runs.values())
        return self._finished_tokens + self._finished_prompt_tokens + running

    def measure_speed(self, now: float) -> float:
        """Prompt and generated tokens a second over the last 10 s the worker was running jobs: how fast it
        works through a queue (idle time does not lower it). The gateways estimate queue waits with it."""
        then, before = self._speed_sampled
        processed = self.processed_tokens()
        self._speed_sampled = (now, processed)
        if self.runs or processed != before:
            self._busy_s += now - then
            self.info.speed_tokens_per_s = round(self._speed.update(processed, self._busy_s), 2)
        return self.info.speed_tokens_per_s

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _heartbeat_loop(self) -> None:
        ttl = self.settings.heartbeat_ttl_s
        late = False
        while True:
            # A beat that took long (Redis stalled) is followed by another at once.
            if await wait_set(self._leaving, 0 if late else ttl / 4):
                return
            began = time.monotonic()
            self.info.in_flight = len(self.runs)
            self.info.generated_tokens = self.generated_tokens()
            self.info.tokens_per_s = round(
                self._throughput.update(self.info.generated_tokens, time.monotonic()), 2
            )
            self.measure_speed(time.monotonic())
            try:
                await asyncio.wait_for(self._beat(ttl), ttl / 2)
            except (RedisError, TimeoutError) as e:
                logger.warning("heartbeat failed (%s)", e or "Redis did not answer in time")
            late = time.monotonic() - began > ttl / 4

    async def _beat(self, ttl: float) -> None:
        await heartbeat(self.redis, self.info, ttl, self.settings.job_ttl_s)
        await self.queue.renew_leases([run.claim for run in self.runs.values()], ttl)

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
                        self._interactive_wake.set()
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

    def _full(self) -> bool:
        return self.free_slots() == 0 and any(not run.engine_done for run in self.runs.values())

    async def _overshare(self) -> list[JobRun]:
        """For the key of the job at the head of the interactive queue: the latest-started interactive
        job of the key that holds the most of this worker's slots, when it holds at least two more."""
        if not self._full():
            return []
        running = [
            run
            for run in self.runs.values()
            if not run.engine_done
            and not run.preempt_requested
            and run.spec.priority is PriorityClass.interactive
        ]
        head = await self.queue.head_owner(self.model, PriorityClass.interactive)
        held = Counter(run.claim.owner for run in running)
        if head is None or not held:
            return []
        owner, most = held.most_common(1)[0]
        if owner == head or most - held[head] < 2:
            return []
        return [max((run for run in running if run.claim.owner == owner), key=lambda run: run.started_at)]

    def _preemptable(self) -> list[JobRun]:
        """The batch jobs to stop when interactive jobs wait and no slot is free: on continuous
        batching any batch row (latest started first); on the static scheduler the whole batch, and
        only when every job in it is batch work."""
        busy = [run for run in self.runs.values() if not run.engine_done and not run.preempted]
        if not busy or self.free_slots() > 0:
            return []
        batch = [run for run in busy if run.spec.priority is PriorityClass.batch]
        if not self.engine.continuous_batching:
            return batch if len(batch) == len(busy) else []
        return sorted(batch, key=lambda run: run.started_at, reverse=True)

    async def _preempt_loop(self) -> None:
        """Batch yields to interactive, and a key holding most slots to another key's waiting job:
        checked when jobs are submitted, and every claim poll."""
        wait = self.settings.preempt_after_s
        while True:
            await wait_set(self._interactive_wake, self.settings.claim_poll_s)
            self._interactive_wake.clear()
            for_keys = self.settings.preempt_for_keys and self.engine.continuous_batching
            if not self._preemptable() and not (for_keys and self._full()):
                continue
            try:
                if not (await self.queue.waiting(self.model))[PriorityClass.interactive]:
                    continue
                await asyncio.sleep(wait)  # a worker with a free slot may take them meanwhile
                waiting = (await self.queue.waiting(self.model))[PriorityClass.interactive]
                victims, behind = self._preemptable(), False
                if self.engine.continuous_batching:
                    victims = victims[:waiting]
                if not victims and for_keys and waiting:
                    await asyncio.sleep(max(0.0, self.settings.preempt_for_keys_after_s - wait))
                    victims, behind = await self._overshare(), True
                # Workers full of batch work all see the same waiting jobs: only as many slots are
                # freed, fleet-wide, as jobs wait.
                if not victims or not await self.queue.reserve_preemption(
                    self.model, len(victims), waiting, self.settings.heartbeat_ttl_s
                ):
                    continue
            except RedisError as e:
                logger.warning("reading the queue failed (%s)", e)
                continue
            for run in victims:
                if run.preempt_requested or run.engine_done:  # reserved, and ended on its own
                    with contextlib.suppress(RedisError):
                        await self.queue.end_preemption(self.model, self.settings.heartbeat_ttl_s)
                    continue
                if behind:
                    logger.info("job %s: preempted for another key's waiting job", run.job_id)
                else:
                    logger.info("job %s: batch work preempted for %d interactive jobs", run.job_id, waiting)
                run.preempt(behind=behind)

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


def together_window(window_s: float, claims: list[Claim], now: float) -> float:
    """How much longer a static batch waits for jobs submitted together with the first of `claims`:
    a tenth of the window after that job's submission (none once that has passed: such jobs would be
    in the queue by now, and claimed with it). A submission time ahead of this clock (another host's)
    counts as now."""
    first = min(_submitted_at(claim) for claim in claims)
    return max(0.0, window_s / 10 - max(0.0, now - first))


def _submitted_at(claim: Claim) -> float:
    try:
        return parse_job_payload(claim.payload).submitted_at
    except MalformedJob:
        return 0.0
