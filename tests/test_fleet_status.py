"""`ortfleet status` and `ortfleet top`: the fleet at a glance, read from Redis, on a real fleet."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from ortfleet.fleet.processes import free_port
from tests.conftest import Fleet, RedisServer
from tests.jobs_client import submit, wait_done
from tests.test_cli import ortfleet
from worker.engines.batcher.engine import DEFAULT_SLOTS


def status_json(redis_url: str) -> dict[str, Any]:
    result = ortfleet("status", "--redis-url", redis_url, "--json")
    assert result.returncode == 0, result.stderr
    status: dict[str, Any] = json.loads(result.stdout)
    return status


async def test_status_shows_the_running_workers_their_queue_and_the_jobs_of_the_last_minute(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str, redis_server: RedisServer
) -> None:
    ports = [free_port(), free_port()]
    workers = [fleet.start_worker(model_name, "--metrics-port", str(port)) for port in ports]
    jobs = [await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 32}) for _ in range(3)]
    too_long = await submit(client, {"model": model_name, "prompt": "word " * 2000, "max_tokens": 4})
    for job in jobs:
        assert (await wait_done(client, job["id"]))["status"] == "succeeded"
    assert (await wait_done(client, too_long["id"]))["status"] == "failed"

    deadline = time.monotonic() + 15  # token counts and rates are written with each heartbeat
    while True:
        status = status_json(redis_server.url)
        mine = [w for w in status["workers"] if w["model"] == model_name]
        if sum(w["generated_tokens"] for w in mine) == 3 * 32 and sum(w["tokens_per_s"] for w in mine) > 0:
            break
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.3)

    assert sorted(w["metrics_url"] for w in mine) == sorted(f"http://127.0.0.1:{p}/metrics" for p in ports)
    for worker in mine:
        assert (
            worker["device"] == "cpu" and worker["state"] == "ready" and worker["capacity"] == DEFAULT_SLOTS
        )
        assert worker["heartbeat_age_s"] < 5
    [model] = [m for m in status["models"] if m["name"] == model_name]
    assert model["workers"] == 2 and model["capacity"] == 2 * DEFAULT_SLOTS and model["queued"] == 0
    assert model["finished_last_minute"] == 4
    assert model["failed_last_minute"] == 1

    table = ortfleet("status", "--redis-url", redis_server.url)
    assert table.returncode == 0, table.stderr
    for worker in workers:
        [line] = [line for line in table.stdout.splitlines() if f"-{worker.process.pid}-" in line]
        assert model_name in line and " cpu " in line and "/metrics" in line
    [model_line] = [line for line in table.stdout.splitlines() if line.startswith(f"{model_name} ")]
    assert model_line.split()[1:6] == [
        "2",
        str(2 * DEFAULT_SLOTS),
        "0",
        "0",
        "-",
    ]  # workers, slots, in flight, queued, wait
    assert model_line.split()[-2:] == ["4", "1"]  # done and failed in the last minute


async def test_top_refreshes_the_same_view_until_told_to_stop(
    fleet: Fleet, model_name: str, redis_server: RedisServer
) -> None:
    worker = fleet.start_worker(model_name)

    result = ortfleet("top", "--redis-url", redis_server.url, "--iterations", "2", "--interval", "0.1")

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len([line for line in lines if line.startswith("ortfleet  ")]) == 2, result.stdout
    assert len([line for line in lines if f"-{worker.process.pid}-" in line]) == 2, result.stdout


def test_status_says_when_redis_cannot_be_reached() -> None:
    result = ortfleet("status", "--redis-url", f"redis://:secret@127.0.0.1:{free_port()}/0")

    assert result.returncode == 1
    assert "cannot read the fleet from Redis at redis://:****@127.0.0.1:" in result.stderr
    assert "secret" not in result.stderr
