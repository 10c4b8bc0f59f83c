"""Overload: a bounded queue, 429s instead of collapse, and memory that stays bounded."""

from __future__ import annotations

import asyncio

import httpx
import psutil
from redis.asyncio import Redis

from tests.conftest import Fleet, keys
from tests.jobs_client import read_events, streamed_text, submit, wait_done


async def test_ten_thousand_queued_jobs_fill_the_queue_and_the_next_one_gets_429(
    fleet: Fleet, model_name: str, redis: Redis
) -> None:
    gateway, url = fleet.start_gateway(env={"ORTFLEET_MAX_QUEUED_JOBS": "10000"})
    # The worker stays live (its heartbeat goes on) but takes two seconds a token: the queue fills up.
    fleet.start_worker(model_name, env={"ORTFLEET_STEP_DELAY_S": "2"})
    memory_before = await redis.info("memory")
    body = {"model": model_name, "prompt": "Hello there", "max_tokens": 100}
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=32)) as client:

        async def submit_many(count: int) -> list[int]:
            return [(await client.post("/v1/jobs", json=body)).status_code for _ in range(count)]

        batches = await asyncio.gather(*(submit_many(626) for _ in range(16)))
        codes = [code for batch in batches for code in batch]
        queued = await redis.zcard(keys.queue(model_name))
        assert queued == 10_000
        started = codes.count(202) - queued  # claimed by the worker before the queue filled
        assert 0 <= started <= 8
        assert codes.count(429) == len(codes) - codes.count(202) > 0
        over = await client.post("/v1/jobs", json=body)
        assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
        assert (await client.get("/healthz")).status_code == 200
    memory_after = await redis.info("memory")
    per_job = (memory_after["used_memory"] - memory_before["used_memory"]) / 10_000
    assert per_job < 8192, f"{per_job:.0f} bytes of Redis memory per queued job"
    assert psutil.Process(gateway.process.pid).memory_info().rss < 512 * 2**20


async def test_ten_times_the_capacity_offered_at_once_all_completes(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name)
    capacity = next(
        m["capacity"] for m in (await client.get("/v1/models")).json()["data"] if m["id"] == model_name
    )
    jobs = await asyncio.gather(
        *(
            submit(client, {"model": model_name, "prompt": f"Job {i}", "max_tokens": 32})
            for i in range(10 * capacity)
        )
    )
    streams = await asyncio.gather(*(read_events(client, job["id"]) for job in jobs))
    done = await asyncio.gather(*(wait_done(client, job["id"]) for job in jobs))
    assert [d["status"] for d in done] == ["succeeded"] * len(jobs)
    assert [streamed_text(s) for s in streams] == [d["output"] for d in done]
