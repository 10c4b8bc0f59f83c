"""A worker's side of LoRA adapters loaded at run time (worker/adapter_service.py), on a real Redis with an
engine that records what it is told: the calls on the worker's list are answered one at a time in their
order, a refusal is answered with its reason, and a worker that registers matches its adapters to its
model's record."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from redis.asyncio import Redis

from common.adapter_calls import AdapterCall, AdapterReply
from common.keys import STANDALONE
from common.registry import WorkerInfo
from tests.conftest import RedisServer
from worker.adapter_service import AdapterService
from worker.engines.batcher.lora import AdapterMismatch


class RecordingEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def load_adapter(self, name: str, folder: Path) -> None:
        if name == "misfit":
            raise AdapterMismatch(f"the adapter {name!r} ({folder}) does not fit the base model: q_proj")
        self.calls.append(("load", name))

    async def unload_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))


class Heartbeat:
    def __init__(self) -> None:
        self.registered = asyncio.Event()
        self.beats = 0

    async def beat_now(self) -> None:
        self.beats += 1


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


def worker(redis: Redis, adapters: dict[str, str], runtime: list[str]) -> Any:
    info = WorkerInfo(
        id=f"w-{secrets.token_hex(4)}",
        model=f"m-{secrets.token_hex(4)}",
        device="cpu",
        gpu="",
        capacity=4,
        context_length=128,
        continuous_batching=True,
        host="h",
        pid=1,
        started_at=time.time(),
        adapters=adapters,
        runtime_adapters=runtime,
    )
    announced: list[str] = []  # the adapters the service told the metrics it loaded
    return SimpleNamespace(
        info=info,
        engine=RecordingEngine(),
        heartbeat=Heartbeat(),
        redis=redis,
        keys=STANDALONE,
        announced=announced,
        on_adapter_loaded=announced.append,
    )


async def test_a_worker_that_registers_matches_its_runtime_adapters_to_its_models_record(
    redis: Redis,
) -> None:
    service = worker(redis, {"given": "/g", "old": "/o"}, ["old"])
    await redis.hset(STANDALONE.runtime_adapters(service.info.model), mapping={"new": "/n"})

    await AdapterService(service, None).match_record()

    assert service.engine.calls == [("unload", "old"), ("load", "new")]
    assert service.info.adapters == {"given": "/g", "new": "/n"} and service.info.runtime_adapters == ["new"]
    assert service.announced == ["new"]
    assert service.heartbeat.beats == 2  # its registry entry says so at once


async def test_calls_on_a_workers_list_are_answered_in_their_order_a_refusal_with_its_reason(
    redis: Redis,
) -> None:
    service = worker(redis, {}, [])
    running = asyncio.create_task(AdapterService(service, None).run())
    service.heartbeat.registered.set()
    deadline = time.time() + 60
    calls = [
        AdapterCall(id="c1", op="load", name="sql", path="/sql", deadline=deadline),
        AdapterCall(id="c2", op="load", name="misfit", path="/misfit", deadline=deadline),
        AdapterCall(id="c3", op="unload", name="sql", deadline=deadline),
        AdapterCall(id="c4", op="unload", name="never-loaded", deadline=deadline),
    ]
    for call in calls:
        await redis.lpush(STANDALONE.adapter_calls(service.info.id), call.model_dump_json())

    replies = []
    for call in calls:
        popped = await redis.blpop([STANDALONE.adapter_reply(call.id)], timeout=30)  # type: ignore[misc]
        assert popped is not None
        replies.append(AdapterReply.model_validate_json(popped[1]))
    running.cancel()

    assert [reply.ok for reply in replies] == [True, False, True, True]
    assert replies[1].error is not None and "q_proj" in replies[1].error
    assert service.engine.calls == [("load", "sql"), ("unload", "sql")]
    assert service.info.adapters == {} and service.info.runtime_adapters == []
    assert service.announced == ["sql"]  # the refused one is not


async def test_a_worker_whose_engine_serves_no_adapters_refuses_a_load_naming_why(redis: Redis) -> None:
    service = worker(redis, {}, [])
    why = "LoRA adapters are served only by ortfleet's batcher, and this worker runs og.Engine"

    reply = await AdapterService(service, why).answer(
        AdapterCall(id="c", op="load", name="sql", path="/sql", deadline=time.time() + 60)
    )

    assert not reply.ok and reply.error == why and service.engine.calls == []
