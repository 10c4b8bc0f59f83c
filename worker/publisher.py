"""Writes the running jobs' token entries to their Redis streams: one script call per engine step.

Every job's publisher hands its entries to the worker's `StepWriter`. The writer sends what all jobs
added since its last write in one call, as soon as no write is in flight: the entries of one engine
step (added in one event-loop wake-up) go together, a job's first token goes out at once, and
what comes while a write is in flight goes with the next one, except a job's first token: that one
never waits for other jobs' write. A plain write's reply (tokens of jobs already streaming) is read
when the next write is due, in the wake-up that brings the next step's tokens, so that the worker is
woken once per step rather than once more for each reply; a write someone waits for is read at once.

With a stream interval of n tokens, a job's tokens wait until it has n of them (its first token, any
other entry, and what is left when the job ends go at once); a write takes every job's pending
entries, so jobs that started apart fall into step and share their writes.

Coalescing: each write of a job's entries costs Redis about the same whatever it carries (a script's
work per job: fence, stream tail, XADD, record). While the worker adds more token entries a second
(one a job and engine step) than `writes_per_s` (a GPU's many rows), a job's tokens wait to go
together: up to (jobs streaming) / `writes_per_s` seconds after the first of them arrived, at most
`max_wait_s`, so that the worker makes about `writes_per_s` job writes a second however many rows it
steps. A write for a first token or an urgent entry takes only those; one for tokens due by their age
takes every job's, so that the jobs share one write per wait. While coalescing (or with a stream
interval), a write makes a job's consecutive token entries one entry: Redis' work, the notice's and
each relay's go per write of a job, not per token. Otherwise each engine step's tokens keep an entry of
their own, as readers at a low rate expect. Below that rate every step's tokens go out at once, so a
stream's inter-token latency stays the engine's step time.

Replication to Redis replicas is asynchronous: after a failover, the new primary may lack the last
token entries the worker wrote to the old one. The write script then refuses the job's next write (its
first token would leave a gap), and the writer first writes again, from what it keeps, every token
entry from where the stream's tokens end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from redis.exceptions import RedisError

from common.events import TOKEN, merge_token_entries, token_entry
from common.jobs.queue import JobQueue
from common.jobs.writes import StepResult, StepWrite

logger = logging.getLogger(__name__)


class LeaseLost(Exception):
    """Another attempt owns the job now: this worker must stop writing to it."""


class StreamPublisher:
    """One job's entries on their way to its stream."""

    def __init__(self, writer: StepWriter, job_id: str, attempt: int, first_index: int = 0) -> None:
        self._writer = writer
        self.job_id = job_id
        self.attempt = attempt
        self.first_index = first_index  # this attempt's first token's index (earlier attempts wrote the rest)
        self.streamed_to = first_index  # where the tokens this attempt wrote end
        # Its token entries in Redis, written again if a failover loses them.
        self.written: list[dict[str, str]] = []
        self.gap = False  # the stream lacks some of `written`: write them again before anything else
        self.unfillable = False  # the stream lacks tokens of an earlier attempt: they cannot be written again
        self.pending: list[dict[str, str]] = []
        self.pending_since = 0.0  # when the oldest of `pending` was added (time.monotonic())
        # The first of `pending` that are written again as they were written before (a failover lost
        # them): a reader may hold them already, and knows them by their first token's index.
        self.verbatim = 0
        self.record: dict[str, str] = {}
        self.idle = asyncio.Event()
        self.idle.set()
        self.lost = False
        self.token_written = False  # a token entry of the job reached Redis
        self.in_flight = False  # a write with entries of this job is out
        self.in_flight_entries = 0  # how many of the first of `pending` that write took
        # Something pending must not wait for the stream interval; while it is False, `pending` holds
        # only token entries.
        self.urgent = False
        # Where the tokens of the last of `pending` end, while it is a plain token entry (its text, ids
        # and index only) that later tokens may join (None: it is not, or nothing is pending).
        self.open_end: int | None = None

    def add_tokens(
        self,
        text: str,
        token_ids: list[int],
        index: int,
        logprobs: list[dict[str, Any]] | None = None,
        record: dict[str, str] | None = None,
    ) -> None:
        """Queue a token entry (common.events.token_entry's fields), and fields to set on the job's record.
        While the writer coalesces, plain tokens that follow the last pending entry's join it at once,
        as the write would join them (merge_token_entries), rather than wait as an entry of their own."""
        end = self.open_end
        pending = self.pending
        if (
            end == index
            and logprobs is None
            and not record
            and self._writer.joins_tokens
            # an entry a write has taken is never changed, nor one written again as it was
            and len(pending) > self.in_flight_entries
            and len(pending) > self.verbatim
            and not self.lost
        ):
            last = pending[-1]
            last["text"] += text
            if token_ids:
                ids = str(token_ids[0]) if len(token_ids) == 1 else ",".join(map(str, token_ids))
                last["ids"] = last["ids"] + "," + ids if last["ids"] else ids
                self.open_end = end + len(token_ids)
            # Nothing else changes: the publisher waits for the writer already, and is due no sooner.
            self._writer.entries_added += 1
            return
        self.add(token_entry(text, token_ids, index, logprobs), record)
        if logprobs is None and not self.lost and len(self.pending) > self.verbatim:
            self.open_end = index + len(token_ids)

    def add(self, entry: dict[str, str], record: dict[str, str] | None = None) -> None:
        """Queue a stream entry, and fields to set on the job's record in the same write."""
        if self.lost:
            return
        self.open_end = None
        if not self.pending:
            self.pending_since = time.monotonic()
        self.pending.append(entry)
        self._writer.entries_added += 1
        if record or entry.get("type") != TOKEN:
            self.urgent = True
        if record:
            self.record.update(record)
        self.idle.clear()
        self._writer.wake(self)

    @property
    def pressing(self) -> bool:
        """Whether what it has pending never waits: something urgent, a gap to fill, or the job's first
        token not out yet."""
        return self.urgent or self.gap or not self.token_written

    async def drain(self) -> None:
        """Wait until everything added so far is in Redis; raises LeaseLost if the job was taken over."""
        self._flush()
        await self.idle.wait()
        if self.lost:
            raise LeaseLost(self.job_id)

    async def close(self) -> None:
        """Writes what is still pending (unless the job was taken over), then leaves the writer."""
        self._flush()
        await self.idle.wait()
        self._writer.forget(self)

    def _flush(self) -> None:
        """What is pending goes without waiting for the stream interval: someone waits for it."""
        if not self.idle.is_set():
            self.urgent = True
            self._writer.wake(self)

    async def fill_gap(self) -> bool:
        """Writes again the token entries the stream lacks; False when some cannot be (an earlier
        attempt's), and raises LeaseLost if the job was taken over."""
        self.gap = True
        self.idle.clear()
        self._writer.wake(self)
        await self.drain()
        return not self.unfillable


class StepWriter:
    """The worker's one writer of token entries, for all of its running jobs."""

    def __init__(
        self,
        queue: JobQueue,
        max_batch: int,
        interval: int = 1,
        *,
        max_wait_s: float = 0.0,
        writes_per_s: float = math.inf,
    ) -> None:
        self._queue = queue
        self._max_batch = max_batch  # most entries of one job in one write
        self._interval = interval  # a job's tokens wait until it has this many (its first never waits)
        self._max_wait_s = max_wait_s  # the longest a job's tokens wait to go together (0: never)
        self._writes_per_s = writes_per_s  # job writes a second it aims at
        self._wait_s = 0.0
        # Whether a job's consecutive plain token entries become one as they are added (coalescing, with a
        # stream interval of one: the interval counts entries); set with wait_s, read at every token.
        self.joins_tokens = False
        self._jobs: set[StreamPublisher] = set()  # the publishers not yet closed
        self.entries_added = 0  # since `_rate_since` (their rate decides `coalescing`)
        self._rate_since = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: dict[StreamPublisher, None] = {}  # publishers with entries to write, in order
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._step_in_flight = False
        self._solo: set[asyncio.Task[None]] = set()
        self._closed = False
        self.writes = 0  # script calls made (for tests and benchmarks)

    def publisher(self, job_id: str, attempt: int, first_index: int = 0) -> StreamPublisher:
        if not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="step-writer")
        publisher = StreamPublisher(self, job_id, attempt, first_index)
        self._jobs.add(publisher)
        return publisher

    def wake(self, publisher: StreamPublisher) -> None:
        if self._closed:
            publisher.idle.set()  # nothing is written any more: no one waits for it
            return
        self._waiting[publisher] = None
        if self._step_in_flight and not publisher.token_written and not publisher.in_flight:
            # Until a job's first token is out, its entries never wait for other jobs' write. It is in
            # flight from now on, so that no step write takes the same entries before this one starts.
            publisher.in_flight = True
            task = asyncio.create_task(self._write([publisher]))
            self._solo.add(task)
            task.add_done_callback(self._solo.discard)
        else:
            self._wakeup.set()

    @property
    def wait_s(self) -> float:
        """How long a job's tokens wait now (coalescing while above 0)."""
        return self._wait_s

    @wait_s.setter
    def wait_s(self, seconds: float) -> None:
        self._wait_s = seconds
        self.joins_tokens = seconds > 0 and self._interval == 1

    @property
    def coalescing(self) -> bool:
        return self.wait_s > 0

    def forget(self, publisher: StreamPublisher) -> None:
        self._jobs.discard(publisher)
        self._waiting.pop(publisher, None)
        publisher.pending.clear()
        publisher.open_end = None
        publisher.idle.set()

    async def close(self) -> None:
        """Stops writing. What is still pending stays unwritten (the jobs' next attempts go on from what
        their streams hold), and no one waits for it: a job's task cancelled after this ends at once."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        tasks = [*self._solo, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for publisher in self._waiting:
            publisher.idle.set()
        self._waiting.clear()

    def _due(self, publisher: StreamPublisher, now: float) -> bool:
        """Whether the publisher's pending entries must go now (unless coalescing, taking every other
        job's along)."""
        if publisher.pressing:
            return True
        # only token entries pending, since not urgent
        if len(publisher.pending) < self._interval:
            return False
        return (
            not self.coalescing
            or now - publisher.pending_since >= self.wait_s
            or len(publisher.pending) >= self._max_batch
        )

    def _measure_rate(self, now: float) -> None:
        """Coalesce or not, by the entries a second added over the last 0.2 s or more (one a job and engine
        step: its tokens)."""
        elapsed = now - self._rate_since
        if elapsed < 0.2:
            return
        rate = self.entries_added / elapsed
        above = self._max_wait_s > 0 and rate > self._writes_per_s
        self.wait_s = min(self._max_wait_s, len(self._jobs) / self._writes_per_s) if above else 0.0
        self.entries_added, self._rate_since = 0, now

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while publishers := self._to_write():
                self._step_in_flight = True
                try:
                    await self._write(publishers)
                finally:
                    self._step_in_flight = False
            self._wake_when_due()

    def _to_write(self) -> list[StreamPublisher]:
        """The publishers the next write takes: none unless one is due; then every waiting one. While
        coalescing, only those due unless one's tokens are due by their age: the jobs then fall into step
        and share one write per window."""
        now = time.monotonic()
        self._measure_rate(now)
        waiting = [p for p in self._waiting if not p.in_flight]
        due = [p for p in waiting if self._due(p, now)]
        if not due:
            return due
        if self.coalescing and all(p.pressing for p in due):
            return due
        return waiting

    def _wake_when_due(self) -> None:
        """While coalescing, wakes the writer when the oldest held tokens are due, should no engine step
        come before (the step itself wakes it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held = [p.pending_since for p in self._waiting if not p.in_flight and p.pending]
        if self.coalescing and held:
            delay = max(0.0, min(held) + self.wait_s - time.monotonic())
            self._timer = asyncio.get_running_loop().call_later(delay, self._wakeup.set)

    async def _write(self, publishers: list[StreamPublisher]) -> None:
        """One script call with what each of `publishers` has pending (at most max_batch entries a job)."""
        writes = []
        for publisher in publishers:
            publisher.in_flight = True
        try:
            if gaps := [publisher for publisher in publishers if publisher.gap]:
                await asyncio.gather(*map(self._take_back, gaps))
        except Exception as e:
            _failed(e, "reading where %d jobs' streams end failed (%s); retrying", len(publishers))
            for publisher in publishers:
                publisher.in_flight = False
            self._wakeup.set()
            await asyncio.sleep(0.25)
            return
        taken = []  # per publisher, how many of its pending entries the write takes
        for publisher in publishers:
            # Fields added while this write is in flight go with the next one.
            record, publisher.record = publisher.record, {}
            entries = publisher.pending[: self._max_batch]
            taken.append(len(entries))
            publisher.in_flight_entries = len(entries)
            if self.coalescing or self._interval > 1:  # tokens that waited to go together: one entry
                kept = publisher.verbatim
                entries = entries[:kept] + merge_token_entries(entries[kept:])
            check = not publisher.unfillable
            writes.append(StepWrite(publisher.job_id, publisher.attempt, entries, record, check_gap=check))
        # A write's outcome is read when the next write is due, unless someone waits for it: the
        # worker is then woken once per engine step, not once more for each write's reply.
        reply_after = None
        if not any(map(_awaited, publishers, writes)):
            reply_after = self._wakeup
            reply_after.clear()  # set by whatever comes next (the run loop looks again after this write)
        try:
            results = await self._queue.publish_step(writes, reply_after)
        except Exception as e:
            _failed(e, "writing tokens of %d jobs failed (%s); retrying", len(writes))
            for publisher, write in zip(publishers, writes, strict=True):
                publisher.record = {**write.record, **publisher.record}
                publisher.open_end = None  # Redis may hold its entries: later tokens go apart
            await asyncio.sleep(0.25)
            return
        finally:
            for publisher in publishers:
                publisher.in_flight = False
                publisher.in_flight_entries = 0
            self._wakeup.set()  # entries that waited for this write go with the next
        self.writes += 1
        for publisher, write, result, count in zip(publishers, writes, results, taken, strict=True):
            if result is StepResult.gap:
                logger.warning(
                    "job %s: its stream lacks tokens written before (a failover?); writing them again",
                    publisher.job_id,
                )
                publisher.gap = True
                publisher.record = {**write.record, **publisher.record}
                continue
            if write.span is not None:
                publisher.token_written = True
                publisher.written += [entry for entry in write.entries if entry.get("type") == TOKEN]
                publisher.streamed_to = max(publisher.streamed_to, write.span[1])
            del publisher.pending[:count]
            if not publisher.pending:
                publisher.open_end = None  # the entry it would have joined is written
            publisher.verbatim = max(0, publisher.verbatim - count)
            publisher.pending_since = time.monotonic()  # the rest came while the write was out
            publisher.urgent = publisher.urgent and bool(publisher.pending or publisher.record)
            if not result:
                job, attempt = publisher.job_id, publisher.attempt
                logger.warning("job %s: lease lost, attempt %s stops writing", job, attempt)
                publisher.lost = True
                publisher.pending.clear()
                publisher.open_end = None
            if not publisher.pending and not publisher.record:
                self._waiting.pop(publisher, None)
                publisher.idle.set()

    async def _take_back(self, publisher: StreamPublisher) -> None:
        """Puts back in front of the publisher's pending entries those of its written token entries the
        stream lacks (it ends before them)."""
        streamed = await self._queue.streamed(publisher.job_id)
        missing = [entry for entry in publisher.written if int(entry["index"]) >= streamed]
        if streamed < publisher.first_index:
            logger.error(
                "job %s: its stream lacks tokens %d to %d of an earlier attempt; its readers miss them",
                publisher.job_id,
                streamed,
                publisher.first_index - 1,
            )
            publisher.unfillable = True
        elif not missing and not publisher.unfillable:
            # What the stream lacks is not among what this attempt kept: writing again cannot fill it,
            # so write on without the check rather than be refused forever.
            logger.error(
                "job %s: its stream ends at token %d, before this attempt's next write, and the tokens "
                "in between are not among those it wrote; it writes on",
                publisher.job_id,
                streamed,
            )
            publisher.unfillable = True
        publisher.written = publisher.written[: len(publisher.written) - len(missing)]
        publisher.pending[:0] = missing
        publisher.verbatim += len(missing)
        publisher.streamed_to = min(publisher.streamed_to, max(streamed, publisher.first_index))
        publisher.gap = False


def _awaited(publisher: StreamPublisher, write: StepWrite) -> bool:
    """Whether someone may wait for the write's outcome: it carries the job's first token entries, record
    fields, or something urgent (entries other than tokens, what a drain or a gap's refill waits for)."""
    return not publisher.token_written or publisher.urgent or bool(write.record)


def _failed(error: Exception, message: str, jobs: int) -> None:
    """Logs a write that failed and is tried again: Redis away is expected, anything else is a fault of
    this process (with its traceback), tried again rather than leave the jobs waiting forever."""
    if isinstance(error, RedisError):
        logger.warning(message, jobs, error)
    else:
        logger.error(message, jobs, error, exc_info=error)
