"""Writes the running jobs' token entries to their Redis streams: one script call per engine step.

Every job's publisher hands its entries to the worker's `StepWriter`. The writer sends what all jobs
added since its last write in one call, as soon as no write is in flight: the entries of one engine
step (added in one event-loop wake-up) go together, a job's first token goes out at once, and
what comes while a write is in flight goes with the next one, except a job's first token: that one
never waits for other jobs' write.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from common.jobqueue import JobQueue, StepWrite
from common.wire import EventType

logger = logging.getLogger(__name__)


class LeaseLost(Exception):
    """Another attempt owns the job now: this worker must stop writing to it."""


class StreamPublisher:
    """One job's entries on their way to its stream."""

    def __init__(self, writer: StepWriter, job_id: str, attempt: int) -> None:
        self._writer = writer
        self.job_id = job_id
        self.attempt = attempt
        self.pending: list[dict[str, str]] = []
        self.record: dict[str, str] = {}
        self.idle = asyncio.Event()
        self.idle.set()
        self.lost = False
        self.token_written = False  # a token entry of the job reached Redis
        self.in_flight = False  # a write with entries of this job is out

    def add(self, entry: dict[str, str], record: dict[str, str] | None = None) -> None:
        """Queue a stream entry, and fields to set on the job's record in the same write."""
        if self.lost:
            return
        self.pending.append(entry)
        if record:
            self.record.update(record)
        self.idle.clear()
        self._writer.wake(self)

    async def drain(self) -> None:
        """Wait until everything added so far is in Redis; raises LeaseLost if the job was taken over."""
        await self.idle.wait()
        if self.lost:
            raise LeaseLost(self.job_id)

    async def close(self) -> None:
        """Writes what is still pending (unless the job was taken over), then leaves the writer."""
        await self.idle.wait()
        self._writer.forget(self)


class StepWriter:
    """The worker's one writer of token entries, for all of its running jobs."""

    def __init__(self, queue: JobQueue, max_batch: int) -> None:
        self._queue = queue
        self._max_batch = max_batch  # most entries of one job in one write
        self._waiting: dict[StreamPublisher, None] = {}  # publishers with entries to write, in order
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._step_in_flight = False
        self._solo: set[asyncio.Task[None]] = set()
        self.writes = 0  # script calls made (for tests and benchmarks)

    def publisher(self, job_id: str, attempt: int) -> StreamPublisher:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="step-writer")
        return StreamPublisher(self, job_id, attempt)

    def wake(self, publisher: StreamPublisher) -> None:
        self._waiting[publisher] = None
        if self._step_in_flight and not publisher.token_written and not publisher.in_flight:
            # Until a job's first token is out, its entries never wait for other jobs' write.
            task = asyncio.create_task(self._write([publisher]))
            self._solo.add(task)
            task.add_done_callback(self._solo.discard)
        else:
            self._wakeup.set()

    def forget(self, publisher: StreamPublisher) -> None:
        self._waiting.pop(publisher, None)
        publisher.pending.clear()
        publisher.idle.set()

    async def close(self) -> None:
        tasks = [*self._solo, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while publishers := [p for p in self._waiting if not p.in_flight]:
                self._step_in_flight = True
                try:
                    await self._write(publishers)
                finally:
                    self._step_in_flight = False

    async def _write(self, publishers: list[StreamPublisher]) -> None:
        """One script call with what each of `publishers` has pending (at most max_batch entries a job)."""
        writes = []
        for publisher in publishers:
            publisher.in_flight = True
            # Fields added while this write is in flight go with the next one.
            record, publisher.record = publisher.record, {}
            entries = publisher.pending[: self._max_batch]
            writes.append(StepWrite(publisher.job_id, publisher.attempt, entries, record))
        try:
            owned = await self._queue.publish_step(writes)
        except RedisError as e:
            logger.warning("writing tokens of %d jobs failed (%s); retrying", len(writes), e)
            for publisher, write in zip(publishers, writes, strict=True):
                publisher.record = {**write.record, **publisher.record}
            await asyncio.sleep(0.25)
            return
        finally:
            for publisher in publishers:
                publisher.in_flight = False
            self._wakeup.set()  # entries that waited for this write go with the next
        self.writes += 1
        for publisher, write, still_owned in zip(publishers, writes, owned, strict=True):
            if any(entry.get("type") == EventType.token.value for entry in write.entries):
                publisher.token_written = True
            del publisher.pending[: len(write.entries)]
            if not still_owned:
                job, attempt = publisher.job_id, publisher.attempt
                logger.warning("job %s: lease lost, attempt %s stops writing", job, attempt)
                publisher.lost = True
                publisher.pending.clear()
            if not publisher.pending and not publisher.record:
                self._waiting.pop(publisher, None)
                publisher.idle.set()
