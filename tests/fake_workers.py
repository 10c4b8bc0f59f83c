"""Worker services on fake engines, run in the test's own event loop against the test Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from common.registry import WorkerInfo
from common.settings import WorkerSettings
from tests.conftest import RedisServer
from worker.fake_engine import FakeEngine
from worker.service import WorkerService

Started = Callable[..., WorkerService]


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


@pytest.fixture
async def start_worker(redis_server: RedisServer, redis: Redis) -> AsyncIterator[Started]:
    """Starts WorkerServices on fake engines (a 4-row one by default), with quick heartbeats and claims
    and any other settings given; stops them at teardown."""
    running: list[tuple[WorkerService, asyncio.Task[None], FakeEngine]] = []

    def start(model: str, engine: FakeEngine | None = None, **overrides: object) -> WorkerService:
        engine = engine or FakeEngine(0.002, 4)
        settings = WorkerSettings(
            redis_url=redis_server.url,
            heartbeat_ttl_s=1.0,
            claim_poll_s=0.2,
            shutdown_grace_s=0.5,
            **overrides,  # type: ignore[arg-type]
        )
        service = WorkerService(settings, redis, engine, engine.tokenizer, worker_info(model, engine))
        running.append((service, asyncio.create_task(service.run()), engine))
        return service

    yield start
    for service, task, engine in running:
        service.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)
        await engine.aclose()
