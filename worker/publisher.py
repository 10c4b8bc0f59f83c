"""Writes a job's token entries to its Redis stream: the first at once, later ones in pipelined batches."""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from common.jobqueue import JobQueue

logger = logging.getLogger(__name__)


class LeaseLost(Exception):
    """Another attempt owns the job now: this worker must stop writing to it."""


class StreamPublisher:
    def __init__(self, queue: JobQueue, job_id: str, attempt: int, max_batch: int) -> None:
        self._queue = queue
        self._job_id = job_id
        self._attempt = attempt
        self._max_batch = max_batch
        self._pending: list[dict[str, str]] = []
        self._record: dict[str, str] = {}
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self.lost = False
        self._task = asyncio.create_task(self._run(), name=f"publish-{job_id}")

    def add(self, entry: dict[str, str], record: dict[str, str] | None = None) -> None:
        """Queue a stream entry, and fields to set on the job's record in the same write."""
        self._pending.append(entry)
        if record:
            self._record.update(record)
        self._idle.clear()
        self._wakeup.set()

    async def drain(self) -> None:
        """Wait until everything added so far is in Redis; raises LeaseLost if the job was taken over."""
        await self._idle.wait()
        if self.lost:
            raise LeaseLost(self._job_id)

    async def close(self) -> None:
        self._closed = True
        self._wakeup.set()
        await self._task

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending and not self.lost:
                batch = self._pending[: self._max_batch]
                # Fields added while this write is in flight go with the next one.
                record, self._record = self._record, {}
                try:
                    owned = await self._queue.publish(self._job_id, self._attempt, batch, record)
                except RedisError as e:
                    logger.warning("job %s: writing tokens failed (%s); retrying", self._job_id, e)
                    self._record = {**record, **self._record}
                    await asyncio.sleep(0.25)
                    continue
                del self._pending[: len(batch)]
                if not owned:
                    logger.warning(
                        "job %s: lease lost, attempt %s stops writing", self._job_id, self._attempt
                    )
                    self.lost = True
                    self._pending.clear()
            self._idle.set()
            if self._closed:
                return
