"""Preemption: batch work yields its slots to waiting interactive jobs, and a key holding more than its
share of a worker's rows yields one to another key's waiting job (worker/row_shares.py), which the
worker's next claim takes. A preempted job goes back to the queue, in its place, and resumes from the
tokens it streamed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from common.aio import wait_set
from common.jobs.queue import JobQueue
from common.wire import PriorityClass
from common.worker_settings import WorkerSettings
from worker.engine import Engine
from worker.job_runner import JobRun
from worker.row_shares import Row, handover

logger = logging.getLogger(__name__)

# Waiting interactive jobs read at the head of the queue when keys' shares are weighed. Jobs of a key
# above its share stand before another key's only when they went back to the queue in their place
# (preempted, or their worker stopped), about as many as the fleet has rows.
_SCAN = 64


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
        self._promised: dict[str, str] = {}  # job id -> owner: waiting jobs a preempted row is for

    def job_submitted(self) -> None:
        self._submitted.set()

    def take_promised(self) -> dict[str, str]:
        """The jobs (id -> owner) this worker freed rows for, for its next claim to take first."""
        promised, self._promised = self._promised, {}
        return promised

    def _full(self) -> bool:
        return self.free_slots() == 0 and any(not run.engine_done for run in self.runs.values())

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

    def _rows(self) -> list[Row]:
        """The interactive jobs running here that no preemption is stopping."""
        return [
            Row(
                job_id=run.job_id,
                owner=run.claim.owner,
                weight=run.weight,
                preemptions=run.preemptions,
                lost_tokens=run.prompt_tokens + len(run.progress.token_ids) + run.tokens_generated,
                started_at=run.started_at,
            )
            for run in self.runs.values()
            if not run.engine_done
            and not run.preempt_requested
            and run.spec.priority is PriorityClass.interactive
        ]

    def _protected(self, row: Row) -> bool:
        """A job resumed after a preemption runs ORTFLEET_PREEMPT_PROTECT_S before it may be preempted
        for another key again."""
        return row.preemptions > 0 and time.time() - row.started_at < self.settings.preempt_protect_s

    async def run(self) -> None:
        """Batch yields to interactive, and a key above its share of the rows to another key's waiting
        job: checked when jobs are submitted, and every claim poll."""
        while True:
            await wait_set(self._submitted, self.settings.claim_poll_s)
            self._submitted.clear()
            try:
                if await self._yield_batch_work():
                    continue
                if self.settings.preempt_for_keys and self.engine.continuous_batching and self._full():
                    await self._yield_row_to_key()
            except RedisError as e:
                logger.warning("reading the queue failed (%s)", e)

    async def _yield_batch_work(self) -> bool:
        """Batch jobs go back to the queue for waiting interactive ones; False when none was due."""
        if not self._preemptable() or not (await self.queue.waiting(self.model))[PriorityClass.interactive]:
            return False
        await asyncio.sleep(self.settings.preempt_after_s)  # a worker with a free slot may take them
        waiting = (await self.queue.waiting(self.model))[PriorityClass.interactive]
        victims = self._preemptable()
        if self.engine.continuous_batching:
            victims = victims[:waiting]
        if not victims:
            return False
        # Workers full of batch work all see the same waiting jobs: only as many slots are freed,
        # fleet-wide, as jobs wait.
        if not await self._reserve(len(victims), waiting):
            return True
        for run in victims:
            if await self._stop(run):
                logger.info("job %s: batch work preempted for %d interactive jobs", run.job_id, waiting)
        return True

    async def _yield_row_to_key(self) -> None:
        """A row of a key above its share goes to another key's job that has waited
        ORTFLEET_PREEMPT_FOR_KEYS_AFTER_S, wherever it stands in the queue: its job goes back to the
        queue, and this worker's next claim takes the waiting job."""
        read = await self.queue.waiting_jobs(self.model, PriorityClass.interactive, _SCAN)
        if handover(self._rows(), read, self.engine.capacity, self._protected) is None:
            return
        await asyncio.sleep(self.settings.preempt_for_keys_after_s)  # a free row elsewhere may take it
        if not self._full():
            return
        seen = {job.id for job in read}
        waited = await self.queue.waiting_jobs(self.model, PriorityClass.interactive, _SCAN)
        choice = handover(
            self._rows(), [job for job in waited if job.id in seen], self.engine.capacity, self._protected
        )
        if choice is None or not await self._reserve(1, choice.eligible):
            return
        run = self.runs.get(choice.row.job_id)
        self._promised[choice.job.id] = choice.job.owner  # before its row can free
        if not await self._stop(run):
            self._promised.pop(choice.job.id, None)
            return
        row, job = choice.row, choice.job
        logger.info(
            "job %s of key %s (above its share) preempted for job %s of key %s",
            row.job_id,
            row.owner,
            job.id,
            job.owner,
        )

    async def _reserve(self, slots: int, waiting: int) -> bool:
        return await self.queue.reserve_preemption(self.model, slots, waiting, self.settings.heartbeat_ttl_s)

    async def _stop(self, run: JobRun | None) -> bool:
        """Preempts a reserved row; False (and its reservation ends) when it ended on its own meanwhile."""
        if run is None or run.preempt_requested or run.engine_done:
            with contextlib.suppress(RedisError):
                await self.queue.end_preemption(self.model, self.settings.heartbeat_ttl_s)
            return False
        run.preempt()
        return True
