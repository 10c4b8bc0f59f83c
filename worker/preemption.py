"""Preemption: batch work yields its slots to waiting interactive jobs, and a key holding most of a
worker's slots yields one to another key's waiting job. A preempted job goes back to the queue and
resumes from the tokens it streamed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable

from redis.exceptions import RedisError

from common.aio import wait_set
from common.jobs.queue import JobQueue
from common.wire import PriorityClass
from common.worker_settings import WorkerSettings
from worker.engine import Engine
from worker.job_runner import JobRun

logger = logging.getLogger(__name__)


class Preemption:
    """Watches one worker's running jobs (`runs`, owned by its WorkerService) and preempts them."""

    def __init__(
        self,
        settings: WorkerSettings,
        queue: JobQueue,
        engine: Engine,
        model: str,
        runs: dict[str, JobRun],
        free_slots: Callable[[], int],
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.engine = engine
        self.model = model
        self.runs = runs
        self.free_slots = free_slots
        self._submitted = asyncio.Event()  # a job was submitted: maybe batch work must yield

    def job_submitted(self) -> None:
        self._submitted.set()

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

    async def run(self) -> None:
        """Batch yields to interactive, and a key holding most slots to another key's waiting job:
        checked when jobs are submitted, and every claim poll."""
        wait = self.settings.preempt_after_s
        while True:
            await wait_set(self._submitted, self.settings.claim_poll_s)
            self._submitted.clear()
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
