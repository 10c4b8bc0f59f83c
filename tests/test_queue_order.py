"""The queue's order on a real Redis: priority classes, weighted fair share between keys by tokens,
jobs going back to their place; and how the waiting jobs show in `ortfleet status` and a job's view."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import httpx
from redis.asyncio import Redis

from common.jobs.queue import JobQueue
from common.jobs.record import RecordUpdate
from common.jobs.submission import QueueLimits
from common.registry import live_workers
from common.wire import JobSpec, JobStatus, PriorityClass, Sampling, Usage
from ortfleet.commands.status import read_status, render
from tests.conftest import Fleet, keys
from tests.jobs_client import submit as submit_http
from tests.jobs_client import wait_done
from tests.queued_jobs import submit
from tests.waiting import until_seen


async def measured_speed(redis: Redis, model: str, within_s: float = 10) -> float:
    """The speed the model's workers published (common/registry.py), once one has measured it."""
    deadline = time.monotonic() + within_s
    speed = 0.0
    while time.monotonic() < deadline and speed <= 0:
        await asyncio.sleep(0.2)
        entries = [entry for entry in await live_workers(redis, keys) if entry.get("model") == model]
        speed = sum(float(entry.get("speed_tokens_per_s", "0")) for entry in entries)
    return speed


async def claim_owners(queue: JobQueue, model: str, count: int) -> list[str]:
    owners = []
    for _ in range(count):
        [claim] = await queue.claim(model, "w", 1, lease_s=30)
        owners.append(claim.owner)
    return owners


# The queue's order


async def test_a_worker_claims_interactive_jobs_before_batch_jobs_submitted_earlier(
    redis: Redis, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    batch = [await submit(queue, model, priority=PriorityClass.batch) for _ in range(3)]
    interactive = [await submit(queue, model) for _ in range(2)]

    claimed = [c.job_id for c in await queue.claim(model, "w", 5, lease_s=30)]

    assert claimed == interactive + batch


async def test_queue_position_counts_every_waiting_job_of_a_higher_class(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    first_batch = await submit(queue, model, priority=PriorityClass.batch)
    second_batch = await submit(queue, model, priority=PriorityClass.batch)
    interactive = await submit(queue, model)

    assert await queue.queue_position(model, interactive, PriorityClass.interactive) == 0
    assert await queue.queue_position(model, first_batch, PriorityClass.batch) == 1
    assert await queue.queue_position(model, second_batch, PriorityClass.batch) == 2


async def test_a_flooding_key_does_not_delay_a_key_that_arrives_later(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    for _ in range(50):
        await submit(queue, model, owner="flood")
    light = await submit(queue, model, owner="light")

    [first] = await queue.claim(model, "w", 1, lease_s=30)

    assert first.job_id != light  # the flood's first job was claimable before the light key arrived
    [second] = await queue.claim(model, "w", 1, lease_s=30)
    assert second.job_id == light


async def test_keys_share_claims_by_tokens_in_proportion_to_their_weights(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    for _ in range(60):
        await submit(queue, model, owner="heavy", weight=3)
    for _ in range(60):
        await submit(queue, model, owner="light", weight=1)

    shares = Counter(await claim_owners(queue, model, 40))

    assert shares == {"heavy": 30, "light": 10}


async def test_fair_share_counts_tokens_not_jobs(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    for _ in range(40):
        await submit(queue, model, owner="long", cost=300)
    for _ in range(40):
        await submit(queue, model, owner="short", cost=100)

    shares = Counter(await claim_owners(queue, model, 20))

    assert shares["short"] == 3 * shares["long"]


async def test_a_key_that_was_idle_holds_no_credit_to_burst_past_others(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    for _ in range(30):
        await submit(queue, model, owner="busy")
    await claim_owners(queue, model, 20)  # the class's virtual time moves on while "idle" sends nothing
    for _ in range(10):
        await submit(queue, model, owner="idle")

    owners = await claim_owners(queue, model, 10)

    assert 4 <= owners.count("idle") <= 6  # they alternate; the idle key does not take all ten first


async def test_finishing_under_the_estimate_gives_the_difference_back(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    await submit(queue, model, owner="thrifty", cost=1000)
    [claim] = await queue.claim(model, "w", 1, lease_s=30)
    before = int(await redis.hget(keys.fair_tags(model, "interactive"), "thrifty"))  # type: ignore[misc]

    usage = Usage(prompt_tokens=5, completion_tokens=5, total_tokens=10)
    await queue.finish(claim, RecordUpdate(status=JobStatus.succeeded, usage=usage), {"type": "done"})

    after = int(await redis.hget(keys.fair_tags(model, "interactive"), "thrifty"))  # type: ignore[misc]
    assert after < before
    served = await redis.hgetall(keys.served_tokens(model))  # type: ignore[misc]
    assert served["interactive"] == "10" and served["interactive:thrifty"] == "10"


async def test_a_batch_job_that_expired_in_its_queue_fails_and_frees_its_owners_slot(
    redis: Redis, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    spec = JobSpec(
        id=f"job_{uuid.uuid4().hex}",
        model=model,
        prompt="Hi",
        sampling=Sampling(max_tokens=2),
        submitted_at=time.time() - 10,
        priority=PriorityClass.batch,
    )
    await queue.submit(spec, limits=QueueLimits(100, 10**9, 1), cost=3, owner="late")
    fresh = await submit(queue, model, owner="late", priority=PriorityClass.batch)

    [claim] = await queue.claim(model, "w", 2, lease_s=30)

    record = await queue.record(spec.id)
    assert claim.job_id == fresh and record is not None and record.error_code is not None
    assert record.error_code.value == "expired_in_queue"
    assert await redis.zscore(keys.active_jobs("late"), spec.id) is None


async def test_a_job_whose_lease_ran_out_goes_back_to_its_place(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    job_id = await submit(queue, model, priority=PriorityClass.batch)
    [lost] = await queue.claim(model, "dead-worker", 1, lease_s=0)
    later = [await submit(queue, model, priority=PriorityClass.batch, owner="other") for _ in range(3)]

    [resumed] = await queue.claim(model, "next-worker", 1, lease_s=30)

    assert resumed.job_id == lost.job_id == job_id and resumed.attempt == 2
    assert await redis.zcard(keys.queue(model, "batch")) == len(later)


async def test_a_preempted_job_goes_back_in_its_place_and_counts_no_attempt(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    job_id = await submit(queue, model, priority=PriorityClass.batch)
    tag = float(await redis.hget(keys.job(job_id), "tag"))  # type: ignore[misc]
    [claim] = await queue.claim(model, "w", 1, lease_s=30)

    assert await queue.release(claim, preempted=True)

    assert await redis.zscore(keys.queue(model, "batch"), job_id) == tag
    record = await queue.record(job_id)
    assert record is not None and record.preemptions == 1 and record.attempts == 1


# Visibility


async def test_status_shows_the_waiting_jobs_per_class_and_the_keys_waiting(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600, keys)
    await submit(queue, model, owner="alice")
    for _ in range(2):
        await submit(queue, model, owner="bob", priority=PriorityClass.batch)
    await redis.hset(keys.models, model, "{}")  # type: ignore[misc]
    try:
        status = await read_status([(redis, keys)])
    finally:
        await redis.hdel(keys.models, model)  # type: ignore[misc]

    [row] = [m for m in status.models if m.name == model]
    assert row.queued == 3 and row.queued_by_class == {"interactive": 1, "batch": 2}
    assert row.waiting_keys == {"interactive:alice": 1, "batch:bob": 2}
    assert "waiting keys: batch:bob (2), interactive:alice (1)" in render(status, "redis://x")


async def test_a_queued_job_shows_its_position_and_an_eta_that_grows_with_the_tokens_ahead(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str, redis: Redis
) -> None:
    worker = fleet.start_worker(model_name)
    small = {"model": model_name, "prompt": "Hi", "max_tokens": 2}  # 3 tokens as estimated
    for _ in range(3):
        await wait_done(client, (await submit_http(client, {**small, "max_tokens": 40}))["id"])
    assert await measured_speed(redis, model_name) > 0
    worker.pause()
    try:
        big = {"model": model_name, "prompt": "ab " * 100, "max_tokens": 200}  # 276 tokens as estimated
        ids = [(await submit_http(client, body))["id"] for body in (big, small, small)]
        batch = (await submit_http(client, {**small, "priority": "batch"}))["id"]
        views: list[dict[str, Any]] = []

        async def estimated() -> bool:  # once the gateway's view of the registry has the speed (0.5 s old)
            views[:] = [(await client.get(f"/v1/jobs/{job_id}")).json() for job_id in [*ids, batch]]
            return all(view["queue_eta_s"] is not None for view in views)

        await until_seen(estimated, "an estimate for every queued job", 5)
        metrics = (await client.get("/metrics")).text
    finally:
        worker.resume()

    assert [v["queue_position"] for v in views] == [0, 1, 2, 3]
    etas = [v["queue_eta_s"] for v in views]
    assert all(eta is not None and eta > 0 for eta in etas) and etas == sorted(etas)
    behind_big, behind_small = etas[1] - etas[0], etas[2] - etas[1]
    assert behind_big > 0 and behind_big >= 5 * behind_small  # 276 tokens ahead against 3
    assert views[3]["priority"] == "batch"
    assert f'ortfleet_queued_jobs{{model="{model_name}",priority="batch"}} 1.0' in metrics
    assert f'ortfleet_served_tokens_total{{model="{model_name}",priority="interactive"}}' in metrics
