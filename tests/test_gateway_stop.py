"""A gateway told to stop (SIGTERM) answers what waits for a job before its graceful shutdown cuts it:
a long-poll gets the job's state as JSON at once, never a plain-text 500."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Fleet, RedisServer
from tests.jobs_client import submit

KEY = "sk-stop-test-0123456789abcdef"
STOPPED_WITHIN_S = 3.0  # well before uvicorn's graceful shutdown (5 s) would cut the request


@pytest.fixture
def one_slot_fleet(redis_server: RedisServer, tiny_model: Path) -> Iterator[Fleet]:
    """A gateway with one API key that may hold one long-poll or stream at a time."""
    fleet = Fleet(redis_server.url, tiny_model)
    fleet.start_gateway({"ORTFLEET_API_KEYS": f"tester:{KEY}", "ORTFLEET_KEY_MAX_OPEN_STREAMS": "1"})
    yield fleet
    fleet.stop_all()


def long_poll(client: httpx.AsyncClient, job_id: str) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(client.get(f"/v1/jobs/{job_id}", params={"wait": 60}, timeout=70))


async def open_long_poll(
    client: httpx.AsyncClient, job_id: str, timeout_s: float = 10
) -> asyncio.Task[httpx.Response]:
    """A long-poll of the job, once the gateway holds it open: a probe for the key's one slot then gets
    429. A long-poll that came while a probe held the slot got 429 itself, and is sent again."""
    deadline = time.monotonic() + timeout_s
    poll = long_poll(client, job_id)
    while (await client.get(f"/v1/jobs/{job_id}", params={"wait": 0.01})).status_code != 429:
        assert time.monotonic() < deadline, f"the long-poll open within {timeout_s:g} s"
        if poll.done():
            assert poll.result().status_code == 429, poll.result().text
            poll = long_poll(client, job_id)
        await asyncio.sleep(0.05)
    return poll


async def test_a_long_poll_open_when_the_gateway_stops_gets_the_jobs_state_as_json(
    one_slot_fleet: Fleet, model_name: str
) -> None:
    one_slot_fleet.start_worker(model_name, "--fake-engine", "1000:1")  # a token a second
    gateway = one_slot_fleet.gateways[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=one_slot_fleet.gateway_url, headers=headers, timeout=30) as client:
        job = await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 100})
        poll = await open_long_poll(client, job["id"])

        gateway.process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        reply = await poll

    assert time.monotonic() - stopped < STOPPED_WITHIN_S
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/json"
    assert reply.json()["id"] == job["id"]
    assert reply.json()["status"] in ("queued", "running")
    assert gateway.process.wait(10) in (0, -signal.SIGTERM)  # uvicorn ends by the signal it was given
