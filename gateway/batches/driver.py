"""The batch driver: every gateway runs one; each step advances the batches whose lease it holds.

validating -> in_progress -> finalizing -> completed, or failed (a malformed input file), or, through
cancelling/finalizing, cancelled and expired. A step is safe to repeat and to interrupt anywhere: a line
is reserved (in flight as 'pending') before its job is submitted under an idempotency key made of the
batch and the line, so a driver that dies between the two leaves a line its successor submits again and
gets the same job; a line is answered only by the atomic script that takes it out of flight.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time

from redis.exceptions import RedisError

from common.aio import wait_set
from common.apikeys import Principal
from common.error_codes import ErrorCode
from common.wire import TERMINAL, JobStatus, PriorityClass
from gateway.batches.lines import (
    MAX_REPORTED_ERRORS,
    LineError,
    check_line,
    custom_id_of,
    finished_line,
    line_job,
    refused_line,
    unanswered_line,
)
from gateway.batches.state import ENDED, PENDING, Batch, BatchState, BatchStatus
from gateway.errors import ApiError
from gateway.files.store import FileStore
from gateway.idempotency import idempotency_digest
from gateway.request_body import JsonLimits
from gateway.state import AppState
from gateway.submission import submit_job

logger = logging.getLogger(__name__)

VALIDATE_CHUNK = 1000
EXPIRE_PER_STEP = 2000
TRANSIENT = frozenset({429, 503})  # the fleet is busy or away: the line waits for a later step
IDLE_TICKS = 10  # while no batch is active, the driver looks again after this many ticks


def _now() -> str:
    return f"{time.time():.3f}"


class BatchDriver:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.settings = state.settings
        self.batches = BatchState(state.redis, state.keys, state.settings.file_ttl_s)
        self.files = FileStore(state.redis, state.keys, state.settings.file_ttl_s)
        self.token = "gw-" + secrets.token_hex(8)
        self.limits = JsonLimits(self.settings.max_json_depth, self.settings.max_number_digits)

    async def run(self) -> None:
        """Steps every active batch it can lease, every `batch_tick_s`, until cancelled. While no batch
        is active anywhere it looks every IDLE_TICKS ticks instead (an idle gateway need not wake twice
        a second for it), and at once when a batch is created on this gateway."""
        try:
            while True:
                ticks = 1
                try:
                    active = await self.batches.active()
                    for batch_id in active:
                        await self._step_alone(batch_id)
                    ticks = 1 if active else IDLE_TICKS
                except RedisError as e:
                    logger.warning("batch driver: Redis unavailable (%s)", e)
                await self._rest(ticks * self.settings.batch_tick_s)
        finally:
            with contextlib.suppress(Exception):
                for batch_id in await self.batches.active():
                    await self.batches.drop_lease(batch_id, token=self.token)

    async def _step_alone(self, batch_id: str) -> None:
        """One batch's step; a fault of its own is logged and stops neither the driver nor the other
        batches (Redis being away stops them all: it is raised)."""
        try:
            await self.step(batch_id)
        except RedisError:
            raise
        except Exception:
            logger.exception("batch driver: the step of batch %s failed", batch_id)

    async def _rest(self, seconds: float) -> None:
        """Sleeps `seconds`, or less if a batch is created on this gateway meanwhile."""
        await wait_set(self.state.batch_created, seconds)
        self.state.batch_created.clear()

    async def step(self, batch_id: str) -> None:
        batch = await self.batches.load(batch_id)
        if batch is None or batch.status in ENDED:
            await self.batches.retire(batch_id)
            return
        if not await self.batches.take_lease(batch_id, token=self.token, lease_s=self.settings.batch_lease_s):
            return
        if batch.status in (BatchStatus.validating, BatchStatus.in_progress) and time.time() >= float(
            batch.fields["expires_at"]
        ):
            await self.batches.move(
                batch_id,
                from_statuses={BatchStatus.validating, BatchStatus.in_progress},
                to=BatchStatus.finalizing,
                fields={"outcome": BatchStatus.expired.value, "finalizing_at": _now()},
                token=self.token,
            )
            batch = await self.batches.load(batch_id)
            if batch is None:
                return
        if batch.status is BatchStatus.validating:
            await self.validate(batch)
        elif batch.status is BatchStatus.in_progress:
            await self.collect(batch)
            if await self.feed(batch):
                await self.batches.move(
                    batch_id,
                    from_statuses={BatchStatus.in_progress},
                    to=BatchStatus.finalizing,
                    fields={"outcome": BatchStatus.completed.value, "finalizing_at": _now()},
                    token=self.token,
                )
        else:
            await self.wind_down(batch)

    def owner(self, batch: Batch) -> Principal:
        limit = batch.number("owner_max_jobs")
        prompt_tokens = batch.number("owner_max_prompt_tokens")
        return Principal(batch.owner, limit or None, max_prompt_tokens_in_flight=prompt_tokens or None)

    async def validate(self, batch: Batch) -> None:
        errors: list[LineError] = []
        seen: set[str] = set()
        total = 0
        start = 0
        while chunk := await self.files.read_lines(batch.input_file_id, start, VALIDATE_CHUNK):
            for offset, raw in enumerate(chunk):
                if not raw.strip():
                    continue
                total += 1
                error = check_line(raw, start + offset + 1, batch.endpoint, seen, self.limits)
                if error is not None and len(errors) < MAX_REPORTED_ERRORS:
                    errors.append(error)
            start += len(chunk)
        if total > self.settings.batch_max_lines:
            errors.insert(
                0,
                LineError(
                    "too_many_requests_in_batch",
                    f"the input file holds {total} requests; a batch takes at most "
                    f"{self.settings.batch_max_lines} (ORTFLEET_BATCH_MAX_LINES)",
                    total,
                ),
            )
        if total == 0:
            errors.append(LineError("empty_file", "the input file holds no requests", 0))
        if errors:
            fields = {"errors": json.dumps([e.as_json() for e in errors]), "failed_at": _now(), "total": "0"}
            await self.batches.move(
                batch.id,
                from_statuses={BatchStatus.validating},
                to=BatchStatus.failed,
                fields=fields,
                token=self.token,
            )
            await self.batches.retire(batch.id)
            self.state.metrics.batches.ended.labels(BatchStatus.failed.value).inc()
            return
        fields = {"total": str(total), "in_progress_at": _now(), "next": "0"}
        await self.batches.move(
            batch.id,
            from_statuses={BatchStatus.validating},
            to=BatchStatus.in_progress,
            fields=fields,
            token=self.token,
        )

    async def feed(self, batch: Batch) -> bool:
        """Keeps up to `batch_max_in_flight` lines queued or running; True once every line is answered."""
        in_flight = await self.batches.in_flight(batch.id)
        for index, job in sorted(in_flight.items()):
            if job == PENDING:
                raw = (await self.files.read_lines(batch.input_file_id, index, 1) or [""])[0]
                if not await self.submit_line(batch, index, raw):
                    return False
        while len(in_flight) < self.settings.batch_max_in_flight:
            reserved = await self.batches.reserve(batch, token=self.token)
            if reserved is None:
                return not in_flight and not await self.batches.in_flight(batch.id)
            index, raw = reserved.index, reserved.line
            in_flight[index] = PENDING
            if not await self.submit_line(batch, index, raw):
                return False
        return False

    async def submit_line(self, batch: Batch, index: int, raw: str) -> bool:
        """Submits line `index` (again, if a driver died after reserving it); False if the fleet is busy."""
        try:
            request = await line_job(self.state, raw, batch.endpoint)
            submitted = await submit_job(
                self.state,
                request,
                self.idempotency_key(batch, index),
                self.owner(batch),
                PriorityClass.batch,
            )
        except ApiError as e:
            if e.status in TRANSIENT or e.code == ErrorCode.idempotency_key_in_use:
                return False
            line = refused_line(custom_id_of(raw), index + 1, batch.id, e)
            if await self.batches.answer(batch, index=index, expected=PENDING, kind="error", line=line):
                self.state.metrics.batches.lines.labels("failed").inc()
            return True
        await self.batches.started(batch.id, index=index, job_id=submitted.job_id)
        return True

    def idempotency_key(self, batch: Batch, index: int) -> str:
        return f"{batch.id}:{index}"

    async def collect(self, batch: Batch) -> int:
        """Answers the lines whose jobs ended; returns how many lines are still in flight."""
        in_flight = await self.batches.in_flight(batch.id)
        running = {index: job for index, job in in_flight.items() if job != PENDING}
        statuses = await self.state.shards.statuses(list(running.values()))
        left = len(in_flight)
        for index, job in running.items():
            status = statuses.get(job)
            if status is not None and status not in TERMINAL:
                continue
            found = await self.state.shards.record(job)
            shard, record = found if found else (None, None)
            raw = (await self.files.read_lines(batch.input_file_id, index, 1) or [""])[0]
            kind, line = finished_line(custom_id_of(raw), index + 1, batch.id, batch.endpoint, job, record)
            if await self.batches.answer(batch, index=index, expected=job, kind=kind, line=line):
                self.state.metrics.batches.lines.labels("completed" if kind == "output" else "failed").inc()
                left -= 1
                if shard is not None and record is not None:
                    await shard.queue.purge(job, record.model)
        return left

    async def wind_down(self, batch: Batch) -> None:
        """A finalizing or cancelling batch: stop what must stop, answer what ended, then end it."""
        outcome = batch.outcome
        in_flight = await self.batches.in_flight(batch.id)
        for index, job in in_flight.items():
            if job == PENDING:
                found = await self.state.shards.idempotent_job(
                    idempotency_digest(self.owner(batch), self.idempotency_key(batch, index))
                )
                if found:
                    await self.batches.started(batch.id, index=index, job_id=found)
                    job = found
                else:
                    raw = (await self.files.read_lines(batch.input_file_id, index, 1) or [""])[0]
                    line = unanswered_line(
                        custom_id_of(raw),
                        index + 1,
                        batch.id,
                        f"batch_{outcome.value}",
                        f"the batch {outcome.value}",
                    )
                    await self.batches.answer(batch, index=index, expected=PENDING, kind="error", line=line)
                    continue
            if outcome is not BatchStatus.completed:
                located = await self.state.shards.record(job)
                if located is None:
                    continue
                shard, record = located
                if record.status is JobStatus.queued or outcome is BatchStatus.expired:
                    await shard.queue.cancel(job, record.model)
        if await self.collect(batch):
            return
        if outcome is BatchStatus.expired:
            for _ in range(EXPIRE_PER_STEP):
                reserved = await self.batches.reserve(batch, token=self.token, status=BatchStatus.finalizing)
                if reserved is None:
                    break
                index, raw = reserved.index, reserved.line
                message = "the batch expired before this request ran"
                line = unanswered_line(custom_id_of(raw), index + 1, batch.id, "batch_expired", message)
                await self.batches.answer(batch, index=index, expected=PENDING, kind="error", line=line)
            else:
                return
        await self.finish(batch, outcome)

    async def finish(self, batch: Batch, outcome: BatchStatus) -> None:
        fresh = await self.batches.load(batch.id)
        if fresh is None:
            return
        written = ((fresh.output_file_id, "output", "completed"), (fresh.error_file_id, "error", "failed"))
        for file_id, kind, counted in written:  # each file that has a line
            if lines := fresh.number(counted):
                name, size = f"{fresh.id}_{kind}.jsonl", fresh.number(f"{kind}_bytes")
                await self.files.register(file_id, fresh.owner, "batch_output", name, size, lines)
        moved = await self.batches.move(
            batch.id,
            from_statuses={BatchStatus.finalizing, BatchStatus.cancelling},
            to=outcome,
            fields={f"{outcome.value}_at": _now()},
            token=self.token,
        )
        if moved.done:
            self.state.metrics.batches.ended.labels(outcome.value).inc()
            await self.batches.retire(batch.id)
