"""The static scheduler's batches: one admits no job until it ends, so the worker gathers the jobs it
expects before it starts one."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from common.jobs.claims import Claim
from common.jobs.payload import MalformedJob, parse_job_payload
from common.jobs.queue import JobQueue
from common.worker_settings import WorkerSettings

logger = logging.getLogger(__name__)


class StaticBatches:
    """Sizes and fills one worker's static batches. `wake` is set when a job is submitted for the model
    (the worker's pub/sub listener sets it, its claim loop waits on it too)."""

    def __init__(
        self, settings: WorkerSettings, queue: JobQueue, model: str, worker_id: str, wake: asyncio.Event
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.model = model
        self.worker_id = worker_id
        self._wake = wake
        self._last_batch = 0  # jobs in the last static batch
        self._ended_at = 0.0  # when the worker last ran out of jobs

    def all_ended(self) -> None:
        """The worker runs no job any more."""
        self._ended_at = time.time()

    async def gather(self, claims: list[Claim], slots: int) -> list[Claim]:
        """The batch to start with the claimed jobs: them, and the jobs claimed while it gathers."""
        if len(claims) < slots:
            claims = claims + await self._fill(claims, slots)
        self._last_batch = len(claims)
        return claims

    def _target(self, claims: list[Claim], slots: int) -> int:
        """How many jobs to gather before a static batch starts (it admits no one until it ends): as
        many as the last batch had, since its clients tend to come back, plus the claimed jobs that
        were submitted while it ran (they could not join it, and would otherwise run one by one)."""
        missed = sum(1 for claim in claims if _submitted_at(claim) < self._ended_at)
        return min(slots, max(len(claims), self._last_batch + missed))

    async def _fill(self, claims: list[Claim], slots: int) -> list[Claim]:
        """More jobs for a static batch, claimed as they are submitted: those it expects, for up to
        static_batch_window_s; otherwise the rest of a tenth of that after the first job's submission,
        for jobs submitted together with it. A wait that ends with no job submitted claims nothing."""
        loop = asyncio.get_running_loop()
        room, target = slots - len(claims), self._target(claims, slots)
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
                    self.model, self.worker_id, room - len(more), self.settings.heartbeat_ttl_s, idle=False
                )
            except RedisError as e:
                logger.warning("claiming jobs failed (%s)", e)
                break
        return more


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
