"""Fault drills on real processes: whatever dies, an accepted job finishes and its stream reads as if
nothing happened."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis

from common.jobs.reads import stage_jobs
from common.jobs.record import JobRecord
from common.wire import JobStatus
from ortfleet.fleet.launcher import FleetProcess
from tests.conftest import Fleet, RedisServer, keys
from tests.jobs_client import Event, read_events, streamed_text, submit, wait_done

# Workers here generate about 100 tokens/s (a pause after each engine step) so faults land mid-stream,
# and their leases last 2 s, so a dead worker's job moves on quickly.
SLOW = {"ORTFLEET_STEP_DELAY_S": "0.01", "ORTFLEET_HEARTBEAT_TTL_S": "2"}


def assert_contiguous(events: list[Event]) -> list[int]:
    """Token events carry each token exactly once, in order: no gap, no duplicate."""
    ids: list[int] = []
    for event in events:
        if event.event == "token":
            assert event.data["index"] == len(ids), (event, len(ids))
            ids += event.data["token_ids"]
    return ids


async def stream_until_tokens(client: httpx.AsyncClient, job_id: str, tokens: int) -> list[str]:
    """Read the raw SSE stream until `tokens` tokens have arrived; return the ids of the events read."""
    seen_ids: list[str] = []
    count = 0
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        async for line in stream.aiter_lines():
            if line.startswith("id: "):
                seen_ids.append(line[4:])
            elif line.startswith("data: ") and '"type":"token"' in line:
                count += len(json.loads(line[6:])["token_ids"])
                if count >= tokens:
                    return seen_ids
    raise AssertionError(f"the stream ended before {tokens} tokens")


async def kill_while_streaming(
    client: httpx.AsyncClient,
    body: dict[str, object],
    doomed: FleetProcess,
    standby: FleetProcess,
    tokens: int,
) -> dict[str, Any]:
    """Submits `body` while `standby` is paused, so that `doomed` takes it; once `tokens` tokens have
    streamed, kills `doomed` (SIGKILL) and lets `standby` go on. Returns the job as submitted."""
    standby.pause()
    try:
        job: dict[str, Any] = await submit(client, body)
        await stream_until_tokens(client, str(job["id"]), tokens)
        doomed.kill()
    finally:
        standby.resume()
    return job


async def reference_output(client: httpx.AsyncClient, body: dict[str, object]) -> str:
    done = await wait_done(client, (await submit(client, body))["id"])
    assert done["status"] == "succeeded" and done["attempts"] == 1
    output: str = done["output"]
    return output


async def test_a_job_whose_worker_is_killed_resumes_on_another_worker_without_gap_or_duplicate(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    body = {"model": model_name, "prompt": "The quick brown fox", "max_tokens": 300}
    first = fleet.start_worker(model_name, env=SLOW)
    second = fleet.start_worker(model_name, env=SLOW)
    expected = await reference_output(client, body)
    job = await kill_while_streaming(client, body, first, second, 40)
    killed_at = time.time()

    events = await read_events(client, job["id"])
    done = await wait_done(client, job["id"])

    assert done["status"] == "succeeded" and done["attempts"] == 2
    assert done["output"] == expected  # greedy decoding: the same text as an uninterrupted run
    assert streamed_text(events) == expected
    ids = assert_contiguous(events)
    assert len(ids) == done["usage"]["completion_tokens"] == 300
    running = [e for e in events if e.data.get("status") == "running"]
    assert [e.data["attempt"] for e in running] == [1, 2]
    resumed_at = int(running[1].id.split("-")[0]) / 1000
    assert resumed_at - killed_at < 10


async def test_a_stopped_worker_finishes_its_jobs_within_the_grace_period(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    worker = fleet.start_worker(model_name, env={**SLOW, "ORTFLEET_SHUTDOWN_GRACE_S": "30"})
    worker.pause()  # both jobs start in one batch
    try:
        jobs = [
            await submit(client, {"model": model_name, "prompt": f"Job {i}", "max_tokens": 100})
            for i in (1, 2)
        ]
    finally:
        worker.resume()
    await stream_until_tokens(client, jobs[0]["id"], 5)
    assert worker.terminate() == 0
    for job in jobs:
        done = await wait_done(client, job["id"], timeout_s=5)
        assert done["status"] == "succeeded" and done["attempts"] == 1
        assert done["usage"]["completion_tokens"] == 100


async def test_a_stopped_worker_hands_unfinished_jobs_back_and_they_resume_elsewhere(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    body = {"model": model_name, "prompt": "Hello world", "max_tokens": 300}
    leaving = fleet.start_worker(model_name, env={**SLOW, "ORTFLEET_SHUTDOWN_GRACE_S": "0.2"})
    staying = fleet.start_worker(model_name, env=SLOW)
    expected = await reference_output(client, body)
    staying.pause()
    try:
        job = await submit(client, body)
        await stream_until_tokens(client, job["id"], 30)
        assert leaving.terminate() == 0
    finally:
        staying.resume()
    done = await wait_done(client, job["id"])
    events = await read_events(client, job["id"])
    assert done["status"] == "succeeded" and done["attempts"] == 2
    assert done["output"] == expected == streamed_text(events)
    assert len(assert_contiguous(events)) == 300


async def test_a_client_resumes_on_another_gateway_after_its_gateway_is_killed(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name, env=SLOW)
    doomed, doomed_url = fleet.start_gateway()
    job = await submit(client, {"model": model_name, "prompt": "Hello", "max_tokens": 120})
    received: list[str] = []
    async with httpx.AsyncClient(base_url=doomed_url, timeout=30) as via_doomed:
        received = await stream_until_tokens(via_doomed, job["id"], 20)
        doomed.kill()
    rest = await read_events(client, job["id"], headers={"Last-Event-ID": received[-1]})
    everything = await read_events(client, job["id"])
    assert [e.id for e in everything] == received + [e.id for e in rest]
    assert len(assert_contiguous(everything)) == 120


async def test_a_full_queue_answers_429_with_retry_after_at_once(fleet: Fleet, model_name: str) -> None:
    _, url = fleet.start_gateway(env={"ORTFLEET_MAX_QUEUED_JOBS": "3", "ORTFLEET_MAX_QUEUED_TOKENS": "1000"})
    worker = fleet.start_worker(model_name)
    worker.pause()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            for _ in range(3):
                await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 4})
            full = await client.post("/v1/jobs", json={"model": model_name, "prompt": "Hi", "max_tokens": 4})
            assert full.status_code == 429
            assert int(full.headers["Retry-After"]) >= 1
            assert "3 jobs" in full.json()["error"]["message"]
    finally:
        worker.resume()


async def test_a_queue_full_of_tokens_answers_429(fleet: Fleet, model_name: str) -> None:
    _, url = fleet.start_gateway(env={"ORTFLEET_MAX_QUEUED_TOKENS": "300"})
    worker = fleet.start_worker(model_name)
    worker.pause()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 200})
            full = await client.post(
                "/v1/jobs", json={"model": model_name, "prompt": "Hi", "max_tokens": 200}
            )
            assert full.status_code == 429 and "queued tokens" in full.json()["error"]["message"]
            small = await client.post(
                "/v1/jobs", json={"model": model_name, "prompt": "Hi", "max_tokens": 50}
            )
            assert small.status_code == 202
    finally:
        worker.resume()
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        assert (await wait_done(client, small.json()["id"]))["status"] == "succeeded"
        again = await client.post("/v1/jobs", json={"model": model_name, "prompt": "Hi", "max_tokens": 200})
        assert again.status_code == 202  # the budget came back when the queued jobs started


async def test_a_job_that_waited_past_the_queue_deadline_fails_as_expired(
    fleet: Fleet, model_name: str
) -> None:
    _, url = fleet.start_gateway(env={"ORTFLEET_QUEUE_TIMEOUT_S": "0.5"})
    worker = fleet.start_worker(model_name)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        worker.pause()
        try:
            job = await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 4})
            await asyncio.sleep(
                0.6 - (time.time() - job["created_at"])
            )  # the deadline itself is what is tested
        finally:
            worker.resume()
        done = await wait_done(client, job["id"])
        assert done["status"] == "failed" and done["attempts"] == 0
        assert done["error"].startswith("expired in queue")
        events = await read_events(client, job["id"])
        assert events[-1].event == "error" and events[-1].data["message"] == done["error"]
        fresh = await wait_done(
            client, (await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 4}))["id"]
        )
        assert fresh["status"] == "succeeded"


async def test_a_malformed_job_in_redis_fails_with_a_clear_error_and_the_worker_lives_on(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str, redis: Redis
) -> None:
    fleet.start_worker(model_name)
    for job_id, payload in [
        ("job_truncated", '{"t": null, "f": "generate", "a": [], "k": {"spec": {"id"'),
        ("job_pickled", "\x80\x04\x95 not json"),
    ]:
        record = JobRecord(id=job_id, model=model_name, status=JobStatus.queued, created_at=time.time())
        await stage_jobs(redis, keys, [record])
        await redis.set(keys.arq_job(job_id), payload, ex=600)
        await redis.zadd(keys.queue(model_name), {job_id: 1})
        await redis.publish(keys.wake_channel(model_name), job_id)
        done = await wait_done(client, job_id, timeout_s=10)
        assert done["status"] == "failed"
        assert "malformed job payload" in done["error"]
    healthy = await wait_done(
        client, (await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 4}))["id"]
    )
    assert healthy["status"] == "succeeded"


async def test_queued_jobs_and_open_streams_survive_a_redis_restart(
    own_redis: RedisServer, tiny_model: Path, model_name: str
) -> None:
    fleet = Fleet(own_redis.url, tiny_model)
    try:
        fleet.start_gateway()
        worker = fleet.start_worker(model_name, env=SLOW)
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=60) as client:
            running = await submit(client, {"model": model_name, "prompt": "Hello", "max_tokens": 400})
            await stream_until_tokens(client, running["id"], 5)
            worker.pause()
            queued = await submit(client, {"model": model_name, "prompt": "Queued", "max_tokens": 8})
            connected = asyncio.Event()
            reader = asyncio.create_task(read_events(client, running["id"], connected=connected))
            await connected.wait()
            own_redis.stop()
            outage = await client.get("/readyz")
            assert outage.status_code == 503 and "Redis" in outage.json()["reason"]
            own_redis.start()
            worker.resume()
            events = await reader
            done = await wait_done(client, running["id"])
            assert done["status"] == "succeeded"
            assert streamed_text(events) == done["output"]
            assert len(assert_contiguous(events)) == done["usage"]["completion_tokens"] == 400
            assert (await wait_done(client, queued["id"]))["status"] == "succeeded"
            assert (await client.get("/readyz")).status_code == 200
    finally:
        fleet.stop_all()
