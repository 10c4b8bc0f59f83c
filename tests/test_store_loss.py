"""A Redis that comes back without its data (restarted with no persistence) is found out within seconds:
every client of a job it held gets `store_lost` (streams, long-polls, waiting OpenAI calls and later
reads), never `job_purged` or a 404, and /readyz and the metrics say so. A file whose lines are gone is
never a 200 with an empty body."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from redis import Redis as SyncRedis

from ortfleet.fleet.processes import free_port, start_redis, stop
from tests.conftest import Fleet
from tests.jobs_client import read_events, submit
from tests.waiting import until

SLOW = {"ORTFLEET_STEP_DELAY_S": "0.05"}
FOUND_WITHIN_S = 10.0  # the watch reads the epoch every second; the rest is room for a busy machine


@dataclass
class VolatileRedis:
    """A redis-server that persists nothing: a restart empties it."""

    port: int
    data: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        stop(self.process)
        self.process = start_redis(self.port, self.data, appendonly=False)


@pytest.fixture
def volatile_redis(tmp_path: Path) -> Iterator[VolatileRedis]:
    port, data = free_port(), tmp_path / "redis"
    server = VolatileRedis(port, data, start_redis(port, data, appendonly=False))
    yield server
    stop(server.process)


@pytest.fixture
def volatile_fleet(volatile_redis: VolatileRedis, tiny_model: Path) -> Iterator[Fleet]:
    fleet = Fleet(volatile_redis.url, tiny_model)
    fleet.start_gateway()
    yield fleet
    fleet.stop_all()


LONG = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}
CHAT = {"max_tokens": 300, "ignore_eos": True}


async def test_clients_of_jobs_a_restarted_empty_redis_lost_get_store_lost_at_once(
    volatile_redis: VolatileRedis, volatile_fleet: Fleet, model_name: str
) -> None:
    volatile_fleet.start_worker(model_name, env=SLOW)
    async with httpx.AsyncClient(base_url=volatile_fleet.gateway_url, timeout=30) as client:
        streamed = await submit(client, {"model": model_name, **LONG})
        polled = await submit(client, {"model": model_name, **LONG})
        connected = asyncio.Event()
        stream = asyncio.create_task(read_events(client, streamed["id"], connected=connected))
        poll = asyncio.create_task(client.get(f"/v1/jobs/{polled['id']}", params={"wait": 60}, timeout=70))
        chat = asyncio.create_task(
            client.post(
                "/v1/chat/completions",
                json={"model": model_name, "messages": [{"role": "user", "content": "Hi"}], **CHAT},
                timeout=70,
            )
        )
        await connected.wait()
        with SyncRedis.from_url(volatile_redis.url) as admin:  # the chat's job is queued: it waits
            await until(lambda: len(admin.keys("ortfleet:job:*")) == 3, "the chat's job queued", 10)

        volatile_redis.restart()
        restarted = time.monotonic()

        events = await asyncio.wait_for(stream, FOUND_WITHIN_S)
        polled_reply = await asyncio.wait_for(poll, FOUND_WITHIN_S)
        chat_reply = await asyncio.wait_for(chat, FOUND_WITHIN_S)
        assert time.monotonic() - restarted < FOUND_WITHIN_S

        assert events[-1].event == "error"
        assert events[-1].data["code"] == "store_lost", events[-1]
        assert polled_reply.status_code == 503, polled_reply.text
        assert polled_reply.json()["error"]["code"] == "store_lost"
        assert chat_reply.status_code == 503, chat_reply.text
        assert chat_reply.json()["error"]["code"] == "store_lost"

        for job in (streamed, polled):
            later = await client.get(f"/v1/jobs/{job['id']}")
            assert later.status_code == 503 and later.json()["error"]["code"] == "store_lost", later.text
        never = await client.get("/v1/jobs/job_never-was-submitted")
        assert never.status_code == 404 and never.json()["error"]["code"] == "job_not_found"

        ready = (await client.get("/readyz")).json()
        assert any("lost its data" in warning for warning in ready.get("warnings", [])), ready
        metrics = (await client.get("/metrics")).text
        losses = next(line for line in metrics.splitlines() if line.startswith("ortfleet_store_losses_total"))
        assert losses.endswith(" 1.0"), losses


async def test_a_gateway_started_after_the_loss_still_names_it(
    volatile_redis: VolatileRedis, volatile_fleet: Fleet, model_name: str
) -> None:
    volatile_fleet.start_worker(model_name)
    async with httpx.AsyncClient(base_url=volatile_fleet.gateway_url, timeout=30) as client:
        job = await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 2})
        volatile_redis.restart()
        # The first submission after the restart finds the loss, whatever the watch has seen yet.
        await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 2})
        _, later_url = volatile_fleet.start_gateway()

    async with httpx.AsyncClient(base_url=later_url, timeout=30) as later:
        reply = await later.get(f"/v1/jobs/{job['id']}")
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "store_lost", reply.text


async def test_a_file_whose_lines_are_gone_is_an_error_not_an_empty_body(
    volatile_redis: VolatileRedis, volatile_fleet: Fleet
) -> None:
    async with httpx.AsyncClient(base_url=volatile_fleet.gateway_url, timeout=30) as client:
        uploaded = await client.post(
            "/v1/files",
            files={"file": ("input.jsonl", b'{"a": 1}\n{"b": 2}\n')},
            data={"purpose": "batch"},
        )
        assert uploaded.status_code == 200, uploaded.text
        file_id = uploaded.json()["id"]
        with SyncRedis.from_url(volatile_redis.url) as admin:  # as an evicting Redis would
            admin.delete(f"ortfleet:file-lines:{file_id}")

        reply = await client.get(f"/v1/files/{file_id}/content")

    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "store_lost"
    assert "0 of its 2 lines" in reply.json()["error"]["message"]
