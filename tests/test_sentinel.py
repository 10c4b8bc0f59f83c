"""Redis high availability: Sentinel URLs, replica-confirmed submissions, a failover while jobs stream."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from common.events import done_entry, token_entry
from common.gateway_settings import GatewaySettings
from common.jobs.claims import Claim
from common.jobs.queue import JobQueue
from common.jobs.record import RecordUpdate
from common.jobs.writes import StreamGap
from common.redis_url import BadRedisUrl, SentinelUrl, mask_url, parse_sentinel_url
from common.stores import Store
from common.wire import JobStatus
from gateway.streaming.reading import batches
from gateway.streaming.relay import StreamRelay
from tests.conftest import Fleet, RedisServer, keys
from tests.jobs_client import submit
from tests.redis_events import fresh_jobs, lose_newest_tokens
from tests.sentinel_group import Reader, SentinelGroup
from tests.waiting import until
from worker.publisher import StepWriter


@pytest.mark.unit
def test_a_sentinel_url_names_its_sentinels_service_database_and_passwords() -> None:
    url = "redis+sentinel://:s3cret@10.0.0.1:26379,sentinel-b,[::1]:26380/main/2?sentinel_password=other"
    assert parse_sentinel_url(url) == SentinelUrl(
        sentinels=(("10.0.0.1", 26379), ("sentinel-b", 26379), ("::1", 26380)),
        service="main",
        db=2,
        password="s3cret",
        sentinel_password="other",
    )
    assert parse_sentinel_url("redis+sentinel://h:1/main").db == 0


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+sentinel://h1:26379,h2:26379", "names no service"),
        ("redis+sentinel:///main", "empty sentinel address"),
        ("redis+sentinel://h1:26379,,h2/main", "empty sentinel address"),
        ("redis+sentinel://h1:99999/main", "outside 1-65535"),
        ("redis+sentinel://h1:port/main", "is not host:port"),
        ("redis+sentinel://h1/main/zero", "'zero' is not a number"),
        ("redis+sentinel://h1/main/²", "'²' is not a number"),
        ("redis+sentinel://h1/main/0/extra", "too many parts"),
        ("redis+sentinel://h1/main?sentinel_pasword=x", "unknown option(s) sentinel_pasword"),
    ],
)
@pytest.mark.unit
def test_a_malformed_sentinel_url_is_refused_at_startup_naming_the_problem(url: str, problem: str) -> None:
    with pytest.raises(BadRedisUrl, match=problem.replace("(", r"\(").replace(")", r"\)")):
        parse_sentinel_url(url)
    with pytest.raises(ValidationError, match="redis_url") as refused:
        GatewaySettings(redis_url=url)
    assert problem in str(refused.value)


@pytest.mark.unit
def test_an_unknown_redis_url_scheme_is_refused_at_startup() -> None:
    with pytest.raises(ValidationError, match="scheme 'http' is not one of"):
        GatewaySettings(redis_url="http://127.0.0.1:6379/0")


@pytest.mark.unit
def test_passwords_in_sentinel_urls_are_masked() -> None:
    url = "redis+sentinel://app:s3cret@h1:26379,h2:26379/main/0?sentinel_password=other"
    assert mask_url(url) == "redis+sentinel://app:****@h1:26379,h2:26379/main/0?sentinel_password=****"
    assert mask_url("redis+sentinel://h1,h2/main") == "redis+sentinel://h1,h2/main"
    assert "oops" not in mask_url("redis+sentinel://:oops@h1:bad,/")  # malformed: still masked
    assert mask_url("redis://:pw@127.0.0.1:6379/0") == "redis://:****@127.0.0.1:6379/0"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


async def test_a_submission_no_replica_confirms_gets_503_not_replicated(
    redis_server: RedisServer, tiny_model: Path, model_name: str
) -> None:
    env = {"ORTFLEET_SUBMIT_REPLICAS": "1", "ORTFLEET_SUBMIT_REPLICAS_TIMEOUT_MS": "50"}
    with Fleet(redis_server.url, tiny_model, env=env) as fleet:
        fleet.start_gateway()
        fleet.start_worker(model_name)
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as client:
            body = {"model": model_name, "prompt": "Hello", "max_tokens": 4}
            reply = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "not_replicated"
    assert "may exist" in error["message"] and "same Idempotency-Key" in error["message"]


async def test_a_worker_writes_again_the_token_entries_a_failover_lost_before_writing_more(
    redis: Redis,
) -> None:
    job_id = "job_failover_gap"
    await fresh_jobs(redis, job_id)
    queue = JobQueue(redis, 3600, keys)
    writer = StepWriter(queue, 64)
    publisher = writer.publisher(job_id, 1)
    for index in range(5):
        publisher.add(token_entry(chr(97 + index), [index], index))
        await publisher.drain()
    await lose_newest_tokens(redis, job_id, 3)

    publisher.add(token_entry("f", [5], 5))
    await publisher.drain()
    stream = [fields for _id, fields in await redis.xrange(keys.events(job_id))]
    assert [int(fields["index"]) for fields in stream] == [0, 1, 2, 3, 4, 5]
    assert "".join(fields["text"] for fields in stream) == "abcdef"

    # The final entry waits for the tokens too.
    await publisher.close()
    await lose_newest_tokens(redis, job_id, 4)
    claim = Claim(job_id, 1, "", "tiny", "")
    final = done_entry(JobStatus.succeeded, "length", None)
    with pytest.raises(StreamGap):
        await queue.finish(claim, RecordUpdate(status=JobStatus.succeeded), final, streamed=6)
    assert await publisher.fill_gap()
    assert await queue.finish(claim, RecordUpdate(status=JobStatus.succeeded), final, streamed=6)
    stream = [fields for _id, fields in await redis.xrange(keys.events(job_id))]
    assert [fields.get("index") for fields in stream] == ["0", "1", "2", "3", "4", "5", None]
    await writer.close()


async def test_an_sse_reader_is_not_sent_a_token_entry_written_again_after_a_failover(
    redis: Redis, redis_server: RedisServer
) -> None:
    job_id = "job_failover_reader"
    stream = keys.events(job_id)
    await redis.delete(stream)
    for index in (0, 1, 2, 1, 2, 3):  # 1 and 2 written again: this reader had them already
        await redis.xadd(stream, token_entry(str(index), [index], index))
    await redis.xadd(stream, done_entry(JobStatus.succeeded, "length", None))
    await redis.expire(stream, 600)  # as a job's stream does
    relay = StreamRelay(Store(redis_server.url, keys), connections=1, buffer=64)
    await relay.start()
    try:
        read = [
            fields async for batch in batches(relay, redis, job_id, "0-0", 5.0) for _id, fields in batch or []
        ]
    finally:
        await relay.close()
    assert [fields.get("index") for fields in read] == ["0", "1", "2", "3", None]


# A primary, one replica and three sentinels on loopback.


async def _final_record(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        reply = await client.get(f"/v1/jobs/{job_id}", params={"wait": 10}, timeout=30)
        if reply.status_code == 200 and reply.json()["status"] in ("succeeded", "failed", "cancelled"):
            job: dict[str, Any] = reply.json()
            return job
        assert time.monotonic() < deadline, reply.text
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_jobs_streaming_through_a_primary_failover_end_succeeded_with_no_gap_or_duplicate(
    sentinels: SentinelGroup, tiny_model: Path, model_name: str
) -> None:
    env = {
        "ORTFLEET_SUBMIT_REPLICAS": "1",
        "ORTFLEET_STEP_DELAY_S": "0.02",
        "ORTFLEET_HEARTBEAT_TTL_S": "15",  # the failover takes seconds: the worker keeps its jobs
    }
    with Fleet(sentinels.url, tiny_model, env=env) as fleet:
        fleet.start_gateway()
        fleet.wait_workers(model_name, 1, watched=fleet.start_worker(model_name, wait=False))
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=120) as client:
            jobs = [
                await submit(client, {"model": model_name, "prompt": f"Story {i}:", "max_tokens": 200})
                for i in range(3)
            ]
            readers = [Reader(job["id"]) for job in jobs]
            reading = [asyncio.create_task(reader.read(client)) for reader in readers]
            await until(lambda: all(r.tokens() >= 10 for r in readers), "every reader gets tokens", 60)

            sentinels.processes[sentinels.primary_port].kill()
            port = sentinels.sentinel_ports[0]
            sentinels.wait_until(
                lambda: sentinels.primary(port) == sentinels.replica_port, "the replica is promoted"
            )

            await asyncio.wait_for(asyncio.gather(*reading), 120)
            finals = [await _final_record(client, job["id"]) for job in jobs]

    for reader, final in zip(readers, finals, strict=True):
        assert final["status"] == "succeeded", final
        tokens = [event for event in reader.events if event.event == "token"]
        indexes = [event.data["index"] for event in tokens]
        assert len(indexes) == len(set(indexes)), f"a token event came twice: {indexes}"
        ids: list[int] = []
        for event in tokens:
            assert event.data["index"] == len(ids), (event, len(ids))
            ids += event.data["token_ids"]
        assert len(ids) == final["usage"]["completion_tokens"]
        assert reader.events[-1].event == "done"
        assert "".join(event.data["text"] for event in tokens) == final["output"]
