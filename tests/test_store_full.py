"""A full Redis (maxmemory reached, noeviction) is named: submissions and writes get 503 store_full
naming memory, /readyz gives memory as its reason (not "no live worker"), a worker says so once a
period rather than at every retry, and every job finishes once Redis has room again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from common.store_watch import OUT_OF_MEMORY
from ortfleet.fleet.launcher import FleetProcess
from tests.conftest import Fleet, RedisServer
from tests.jobs_client import read_events, submit
from tests.test_reliability import assert_contiguous

TOKENS = 40


@pytest.fixture
def own_fleet_with_worker(own_redis: RedisServer, tiny_model: Path, model_name: str) -> Iterator[Fleet]:
    fleet = Fleet(own_redis.url, tiny_model)
    fleet.start_gateway()
    fleet.start_worker(model_name, "--fake-engine", "100:2")  # a token every 100 ms
    yield fleet
    fleet.stop_all()


async def readyz_says(client: httpx.AsyncClient, what: str, timeout_s: float = 10) -> httpx.Response:
    """The first /readyz answer whose reason holds `what` (or that is ready, for `what` "ready")."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = await client.get("/readyz")
        body = reply.json()
        if (what == "ready" and body["status"] == "ready") or what in body.get("reason", ""):
            return reply
        assert time.monotonic() < deadline, f"/readyz said {body} after {timeout_s:g} s"
        await asyncio.sleep(0.1)


async def heartbeat_lapsed(redis: Redis, timeout_s: float = 20) -> None:
    """Until no worker's registry entry is live: its heartbeats have failed for a whole TTL."""
    deadline = time.monotonic() + timeout_s
    while await redis.zrangebyscore("ortfleet:workers", int(time.time() * 1000), "+inf"):
        assert time.monotonic() < deadline, f"a worker still live after {timeout_s:g} s"
        await asyncio.sleep(0.1)


def out_of_memory_lines(worker: FleetProcess) -> list[str]:
    assert worker.log is not None
    return [line for line in worker.log.read_text().splitlines() if OUT_OF_MEMORY in line]


async def test_a_full_redis_is_named_in_errors_readyz_and_once_in_the_workers_log(
    own_fleet_with_worker: Fleet, own_redis_client: Redis, model_name: str
) -> None:
    fleet = own_fleet_with_worker
    job_body = {"model": model_name, "prompt": "Hi", "max_tokens": TOKENS}
    async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as client:
        running = await submit(client, job_body)
        connected = asyncio.Event()
        stream = asyncio.create_task(read_events(client, running["id"], connected=connected))
        await connected.wait()

        await own_redis_client.config_set("maxmemory", "1")  # full, whatever it holds
        ready = await readyz_says(client, "out of memory")
        refused = await client.post("/v1/jobs", json=job_body)
        upload = await client.post(
            "/v1/files", files={"file": ("in.jsonl", b'{"a": 1}\n')}, data={"purpose": "batch"}
        )
        await heartbeat_lapsed(own_redis_client)
        said = out_of_memory_lines(fleet.workers[0])
        still = await client.get("/readyz")

        await own_redis_client.config_set("maxmemory", "0")
        await readyz_says(client, "ready")
        events = await asyncio.wait_for(stream, 30)
        after = await client.post("/v1/jobs", json=job_body)

    assert ready.status_code == 503 and "maxmemory" in ready.json()["reason"], ready.json()
    assert "no live worker" not in still.json()["reason"], still.json()
    for reply in (refused, upload):
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "store_full"
        assert "memory" in reply.json()["error"]["message"]
        assert reply.headers["Retry-After"]
    assert len(said) == 1, said  # many writes and heartbeats failed meanwhile
    assert events[-1].event == "done", events[-1]
    # no gap, no duplicate (the tokens that waited while Redis was full go out together, as one event)
    assert len(assert_contiguous(events)) == TOKENS
    assert after.status_code == 202, after.text
