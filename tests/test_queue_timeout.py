"""ORTFLEET_QUEUE_TIMEOUT_S holds without workers: the gateways' sweep fails a job still queued past its
deadline on time, whether or not a worker of its model is live to reach it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.conftest import Fleet, RedisServer
from tests.jobs_client import read_events, submit

TIMEOUT_S = 1.0


@pytest.fixture
def fleet_without_workers(own_redis: RedisServer, tiny_model: Path, model_name: str) -> Iterator[Fleet]:
    """A gateway that queues jobs for a known model with no live worker, with a short queue timeout; the
    model was served once by a worker that has stopped since."""
    fleet = Fleet(own_redis.url, tiny_model)
    fleet.start_gateway(
        {"ORTFLEET_QUEUE_TIMEOUT_S": str(TIMEOUT_S), "ORTFLEET_QUEUE_WITHOUT_WORKERS": "true"}
    )
    fleet.start_worker(model_name, "--fake-engine", "1:1").terminate()
    yield fleet
    fleet.stop_all()


async def test_a_queued_job_expires_on_time_with_no_worker_at_all(
    fleet_without_workers: Fleet, own_redis_client: Redis, model_name: str
) -> None:
    async with httpx.AsyncClient(base_url=fleet_without_workers.gateway_url, timeout=30) as client:
        submitted = time.monotonic()
        job = await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 2})
        events = await read_events(client, job["id"])
        waited = time.monotonic() - submitted
        reply = await client.get(f"/v1/jobs/{job['id']}")

    assert events[-1].event == "error" and events[-1].data["code"] == "expired_in_queue", events
    assert TIMEOUT_S <= waited < TIMEOUT_S + 4, waited
    view = reply.json()
    assert view["status"] == "failed" and view["error_code"] == "expired_in_queue", view
    assert await own_redis_client.zcard(f"ortfleet:queue:{model_name}") == 0
    assert int(await own_redis_client.get(f"ortfleet:queued-tokens:{model_name}") or 0) == 0
    assert await own_redis_client.zcard("ortfleet:queue-deadlines") == 0
