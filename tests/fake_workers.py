"""Worker services on fake engines, run in the test's own event loop against the test Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from common.registry import WorkerInfo
from common.worker_settings import WorkerSettings
from tests.conftest import RedisServer, keys
from worker.engines.fake_engine import FakeEngine
from worker.service import WorkerService


def worker_info(model: str, engine: FakeEngine) -> WorkerInfo:
    return WorkerInfo(
        id=f"fake-{model}-{time.monotonic_ns()}",
        model=model,
        device="cpu",
        gpu="",
        capacity=engine.capacity,
        context_length=engine.context_length,
        continuous_batching=engine.continuous_batching,
        host="test",
        pid=0,
        started_at=time.time(),
    )


class Started:
    """Starts WorkerServices on fake engines (a 4-row one by default), with quick heartbeats and claims
    and any other settings given."""

    def __init__(self, redis_url: str, redis: Redis) -> None:
        self.redis_url = redis_url
        self.redis = redis
        self.running: dict[WorkerService, tuple[asyncio.Task[None], FakeEngine]] = {}

    def __call__(self, model: str, engine: FakeEngine | None = None, **overrides: object) -> WorkerService:
        engine = engine or FakeEngine(0.002, 4)
        settings = WorkerSettings(
            redis_url=self.redis_url,
            heartbeat_ttl_s=1.0,
            claim_poll_s=0.2,
            shutdown_grace_s=0.5,
            **overrides,  # type: ignore[arg-type]
        )
        service = WorkerService(
            settings, self.redis, engine, engine.tokenizer, worker_info(model, engine), keys
        )
        self.running[service] = (asyncio.create_task(service.run()), engine)
        return service

    def run_of(self, service: WorkerService) -> asyncio.Task[None]:
        """The task running the service: it ends once the service has stopped and left the registry."""
        return self.running[service][0]

    async def stop_all(self) -> None:
        for service, (task, engine) in self.running.items():
            service.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 5)
            await engine.aclose()


@pytest.fixture
async def start_worker(redis_server: RedisServer, redis: Redis) -> AsyncIterator[Started]:
    """Starts WorkerServices on fake engines (see Started); stops them at teardown."""
    started = Started(redis_server.url, redis)
    yield started
    await started.stop_all()
