"""A gateway told to stop (SIGTERM) answers what waits for a job before its graceful shutdown cuts it:
a long-poll gets the job's state as JSON at once, never a plain-text 500; an OpenAI stream ends with an
in-band error and [DONE], an OpenAI call not yet streaming gets 503, and their jobs are cancelled."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Fleet, RedisServer
from tests.jobs_client import submit
from tests.waiting import until, until_seen

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


@dataclass
class OpenCall:
    """A streamed chat completion as the client saw it: status, headers, every `data:` line."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    data: list[str] = field(default_factory=list)
    refusal: dict[str, Any] = field(default_factory=dict)  # the error envelope of a call refused whole

    @property
    def streaming(self) -> bool:
        return any('"content"' in line for line in self.data)


async def stream_chat(client: httpx.AsyncClient, model: str, call: OpenCall) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        call.status, call.headers = response.status_code, dict(response.headers)
        if response.status_code != 200:
            call.refusal = json.loads(await response.aread())
            return
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                call.data.append(line.removeprefix("data: "))


async def test_open_openai_calls_end_with_server_shutting_down_and_their_jobs_are_cancelled(
    fleet: Fleet, model_name: str
) -> None:
    # Two rows, a step every 0.1 s: two calls stream for 30 s, two more wait, held before their answer.
    fleet.start_worker(model_name, env={"ORTFLEET_STEP_DELAY_S": "0.1", "ORTFLEET_MAX_BATCH_SIZE": "2"})
    stopped_gateway, _ = fleet.start_gateway({"ORTFLEET_SSE_KEEPALIVE_S": "30"})
    calls = [OpenCall() for _ in range(4)]
    async with (
        httpx.AsyncClient(base_url=stopped_gateway.url, timeout=60) as client,
        httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as reader,
    ):
        running = [asyncio.create_task(stream_chat(client, model_name, call)) for call in calls[:2]]
        await until(lambda: all(call.streaming for call in calls[:2]), "two calls streaming", 30)
        running += [asyncio.create_task(stream_chat(client, model_name, call)) for call in calls[2:]]

        async def all_queued() -> bool:
            listed = (await reader.get("/v1/jobs", params={"limit": 100})).json()["data"]
            return sum(1 for job in listed if job["model"] == model_name) == 4

        await until_seen(all_queued, "four jobs submitted", 30)
        stopped_gateway.process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*running), STOPPED_WITHIN_S * 2)
        ended_s = time.monotonic() - stopped

        job_ids = [call.headers["x-ortfleet-job-id"] for call in calls]
        ends = [(await reader.get(f"/v1/jobs/{job_id}", params={"wait": 10})).json() for job_id in job_ids]

    assert ended_s < STOPPED_WITHIN_S
    for call in calls[:2]:
        assert call.status == 200 and call.data[-1] == "[DONE]", call.data[-3:]
        error = json.loads(call.data[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error", error
        chunks = [json.loads(line) for line in call.data[:-2]]
        assert all(choice["finish_reason"] is None for chunk in chunks for choice in chunk["choices"])
    for call in calls[2:]:
        assert call.status == 503 and call.headers["retry-after"] == "1", call
        assert call.refusal["error"]["code"] == "server_shutting_down", call.refusal
    assert [end["status"] for end in ends] == ["cancelled"] * 4, ends
    assert stopped_gateway.process.wait(10) in (0, -signal.SIGTERM)
