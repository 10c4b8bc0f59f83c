"""The worker's registry entry: written every quarter of its lease with the worker's state, load, token
counts and speed (the leases of its jobs renewed with it), and removed when the worker leaves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.aio import wait_set
from common.jobs.queue import JobQueue
from common.registry import WorkerInfo, deregister, heartbeat
from common.worker_settings import WorkerSettings
from worker.job_runner import JobRun
from worker.throughput import Throughput

logger = logging.getLogger(__name__)


class Heartbeat:
    """Keeps `info` live in the registry while the worker runs `runs` (owned by its WorkerService)."""

    def __init__(
        self,
        settings: WorkerSettings,
        redis: Redis,
        queue: JobQueue,
        info: WorkerInfo,
        runs: dict[str, JobRun],
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.queue = queue
        self.info = info
        self.runs = runs
        self._leaving = asyncio.Event()  # drained: the heartbeat ends, then the entry is removed
        self.registered = asyncio.Event()  # the first beat is in: the worker is live in the registry
        self._finished_tokens = 0
        self._finished_prompt_tokens = 0
        self._throughput = Throughput(time.monotonic())
        self._busy_s = 0.0  # a clock that runs only while the worker runs jobs: its speed's time base
        self._speed = Throughput(0.0)
        self._speed_sampled = (time.monotonic(), 0)  # when, and the tokens it had processed then

    def count_finished(self, run: JobRun) -> None:
        """Adds the tokens of a run that ended (before it leaves `runs`)."""
        self._finished_tokens += run.tokens_generated
        self._finished_prompt_tokens += run.prompt_tokens

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

    async def register(self) -> None:
        """The first beat: the worker is live in the registry."""
        await heartbeat(
            self.redis, self.queue.keys, self.info, self.settings.heartbeat_ttl_s, self.settings.job_ttl_s
        )
        self.registered.set()

    async def run(self) -> None:
        """Beats until `leave`."""
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
            await self.beat_now()
            late = time.monotonic() - began > ttl / 4

    async def beat(self, ttl: float) -> None:
        await heartbeat(self.redis, self.queue.keys, self.info, ttl, self.settings.job_ttl_s)
        await self.queue.renew_leases([run.claim for run in self.runs.values()], ttl)

    async def beat_now(self) -> None:
        """The registry entry, with the worker's state, written now (by `run`, and when the state
        changes)."""
        ttl = self.settings.heartbeat_ttl_s
        try:
            await asyncio.wait_for(self.beat(ttl), ttl / 2)
        except (RedisError, TimeoutError) as e:
            logger.warning("heartbeat failed (%s)", e or "Redis did not answer in time")

    async def leave(self, beating: asyncio.Task[None]) -> None:
        """Out of the registry. The heartbeat (`beating`, running `run`) ends first, a beat in flight
        included (it is bounded by its own timeout), so that no beat lands after the entry is removed
        and makes it live again."""
        self._leaving.set()
        with contextlib.suppress(Exception):  # its errors were logged as they came
            await asyncio.wait_for(asyncio.shield(beating), self.settings.heartbeat_ttl_s)
        beating.cancel()
        try:
            await deregister(self.redis, self.queue.keys, self.info.id)
        except RedisError as e:
            logger.warning(
                "leaving the registry failed (%s): the worker counts as live until its heartbeat runs out, "
                "in %.0f s",
                e,
                self.settings.heartbeat_ttl_s,
            )
