"""PriorityClass classes, weighted fair share between keys and batch work yielding to interactive work:
the queue on a real Redis, workers on the fake engine, gateways reading a keys file."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from common import keys
from common.apikeys import ApiKeyError, parse_env_keys
from common.jobqueue import JobQueue, QueueLimits
from common.records import RecordUpdate
from common.wire import JobSpec, JobStatus, PriorityClass, Sampling, Usage
from ortfleet.commands.status import read_status, render
from tests.conftest import Fleet
from tests.fake_workers import Started
from tests.jobs_client import read_events, wait_done
from tests.jobs_client import submit as submit_http
from tests.redis_events import wait_final, wait_for_tokens
from tests.test_security import bearer, create_key
from worker.fake_engine import FakeEngine

NO_LIMITS = QueueLimits(10_000, 10**9, 0)
OWNERS = ("team", "flood", "light", "heavy", "long", "short", "busy", "idle", "thrifty", "late", "other")
OWNERS += ("alice", "bob")


@pytest.fixture
async def model(redis: Redis) -> AsyncIterator[str]:
    """A model name of the test's own; its queues and leases (kept without a TTL) go at the end."""
    name = f"sched-{uuid.uuid4().hex[:8]}"
    yield name
    queues = [keys.queue(name, cls.value) for cls in PriorityClass]
    await redis.delete(*queues, keys.leases(name))
    # The owners' active jobs are Redis-wide: jobs left queued here must not count against the
    # API keys of the same names in other tests.
    await redis.delete(*(keys.active_jobs(owner) for owner in OWNERS))
    await redis.delete(*(keys.owner_jobs(owner) for owner in OWNERS))


async def submit(
    queue: JobQueue,
    model: str,
    *,
    owner: str = "team",
    priority: PriorityClass = PriorityClass.interactive,
    weight: float = 1.0,
    cost: int = 10,
    prompt: str = "Hello",
    max_tokens: int = 4,
) -> str:
    spec = JobSpec(
        id=f"job_{uuid.uuid4().hex}",
        model=model,
        prompt=prompt,
        sampling=Sampling(max_tokens=max_tokens),
        submitted_at=time.time(),
        priority=priority,
    )
    await queue.submit(spec, limits=NO_LIMITS, cost=cost, owner=owner, weight=weight)
    return spec.id


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
    queue = JobQueue(redis, 3600)
    batch = [await submit(queue, model, priority=PriorityClass.batch) for _ in range(3)]
    interactive = [await submit(queue, model) for _ in range(2)]

    claimed = [c.job_id for c in await queue.claim(model, "w", 5, lease_s=30)]

    assert claimed == interactive + batch


async def test_queue_position_counts_every_waiting_job_of_a_higher_class(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600)
    first_batch = await submit(queue, model, priority=PriorityClass.batch)
    second_batch = await submit(queue, model, priority=PriorityClass.batch)
    interactive = await submit(queue, model)

    assert await queue.queue_position(model, interactive, PriorityClass.interactive) == 0
    assert await queue.queue_position(model, first_batch, PriorityClass.batch) == 1
    assert await queue.queue_position(model, second_batch, PriorityClass.batch) == 2


async def test_a_flooding_key_does_not_delay_a_key_that_arrives_later(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600)
    for _ in range(50):
        await submit(queue, model, owner="flood")
    light = await submit(queue, model, owner="light")

    [first] = await queue.claim(model, "w", 1, lease_s=30)

    assert first.job_id != light  # the flood's first job was claimable before the light key arrived
    [second] = await queue.claim(model, "w", 1, lease_s=30)
    assert second.job_id == light


async def test_keys_share_claims_by_tokens_in_proportion_to_their_weights(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600)
    for _ in range(60):
        await submit(queue, model, owner="heavy", weight=3)
    for _ in range(60):
        await submit(queue, model, owner="light", weight=1)

    shares = Counter(await claim_owners(queue, model, 40))

    assert shares == {"heavy": 30, "light": 10}


async def test_fair_share_counts_tokens_not_jobs(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600)
    for _ in range(40):
        await submit(queue, model, owner="long", cost=300)
    for _ in range(40):
        await submit(queue, model, owner="short", cost=100)

    shares = Counter(await claim_owners(queue, model, 20))

    assert shares["short"] == 3 * shares["long"]


async def test_a_key_that_was_idle_holds_no_credit_to_burst_past_others(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600)
    for _ in range(30):
        await submit(queue, model, owner="busy")
    await claim_owners(queue, model, 20)  # the class's virtual time moves on while "idle" sends nothing
    for _ in range(10):
        await submit(queue, model, owner="idle")

    owners = await claim_owners(queue, model, 10)

    assert 4 <= owners.count("idle") <= 6  # they alternate; the idle key does not take all ten first


async def test_finishing_under_the_estimate_gives_the_difference_back(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600)
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
    queue = JobQueue(redis, 3600)
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
    queue = JobQueue(redis, 3600)
    job_id = await submit(queue, model, priority=PriorityClass.batch)
    [lost] = await queue.claim(model, "dead-worker", 1, lease_s=0)
    later = [await submit(queue, model, priority=PriorityClass.batch, owner="other") for _ in range(3)]

    [resumed] = await queue.claim(model, "next-worker", 1, lease_s=30)

    assert resumed.job_id == lost.job_id == job_id and resumed.attempt == 2
    assert await redis.zcard(keys.queue(model, "batch")) == len(later)


async def test_a_preempted_job_goes_back_in_its_place_and_counts_no_attempt(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600)
    job_id = await submit(queue, model, priority=PriorityClass.batch)
    tag = float(await redis.hget(keys.job(job_id), "tag"))  # type: ignore[misc]
    [claim] = await queue.claim(model, "w", 1, lease_s=30)

    assert await queue.release(claim, preempted=True)

    assert await redis.zscore(keys.queue(model, "batch"), job_id) == tag
    record = await queue.record(job_id)
    assert record is not None and record.preemptions == 1 and record.attempts == 1


# Workers: batch work yields to interactive work


def fake_text(prompt: str, count: int) -> str:
    return "".join(chr(ord("a") + (len(prompt.encode()) + i) % 26) for i in range(count))


async def assert_exact_stream(redis: Redis, job_id: str, prompt: str, count: int) -> None:
    entries = [f for _i, f in await redis.xrange(keys.events(job_id)) if f["type"] == "token"]
    assert "".join(e["text"] for e in entries) == fake_text(prompt, count)
    indexes = [int(e["index"]) for e in entries]
    assert indexes == sorted(set(indexes))


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous-batching", "static-scheduler"])
async def test_batch_work_yields_to_an_interactive_job_and_resumes_without_gap_or_duplicate(
    redis: Redis, start_worker: Started, model: str, continuous: bool
) -> None:
    queue = JobQueue(redis, 3600)
    engine = FakeEngine(0.01, 2, continuous_batching=continuous)
    service = start_worker(model, engine)
    batch = [
        await submit(queue, model, priority=PriorityClass.batch, prompt=p, max_tokens=80)
        for p in ("ab", "xyz")
    ]
    for job_id in batch:
        await wait_for_tokens(redis, job_id, 3)

    interactive = await submit(queue, model, prompt="Hi", max_tokens=3)
    quick = await wait_final(redis, interactive)
    finals = [await wait_final(redis, job_id) for job_id in batch]

    assert quick["status"] == "succeeded" and quick["output"] == fake_text("Hi", 3)
    assert all(float(quick["finished_at"]) < float(r["finished_at"]) for r in finals)
    assert service.preemptions >= 1
    for job_id, prompt, record in zip(batch, ("ab", "xyz"), finals, strict=True):
        assert record["status"] == "succeeded" and record["output"] == fake_text(prompt, 80)
        await assert_exact_stream(redis, job_id, prompt, 80)
    preempted = [r for r in finals if int(r.get("preemptions", "0"))]
    assert preempted and all(int(r["attempts"]) == 1 + int(r["preemptions"]) for r in preempted)
    if not continuous:
        assert len(preempted) == 2  # the static batch is cut as a whole


async def test_workers_full_of_batch_work_free_only_as_many_slots_as_interactive_jobs_wait(
    redis: Redis, start_worker: Started, model: str
) -> None:
    queue = JobQueue(redis, 3600)
    workers = [start_worker(model, FakeEngine(0.01, 1)) for _ in range(3)]
    batch = [await submit(queue, model, priority=PriorityClass.batch, max_tokens=60) for _ in range(3)]
    for job_id in batch:
        await wait_for_tokens(redis, job_id, 2)

    quick = await wait_final(redis, await submit(queue, model, max_tokens=2))
    finals = [await wait_final(redis, job_id) for job_id in batch]

    assert quick["status"] == "succeeded"
    assert sum(w.preemptions for w in workers) == 1
    assert sum(int(r["preemptions"]) for r in finals) == 1
    assert all(r["status"] == "succeeded" for r in finals)


async def test_without_preemption_an_interactive_job_waits_for_the_batch_work(
    redis: Redis, start_worker: Started, model: str
) -> None:
    queue = JobQueue(redis, 3600)
    service = start_worker(model, FakeEngine(0.005, 1), preempt_batch=False)
    batch = await submit(queue, model, priority=PriorityClass.batch, max_tokens=40)
    await wait_for_tokens(redis, batch, 2)

    interactive = await submit(queue, model, max_tokens=2)
    quick = await wait_final(redis, interactive)
    slow = await wait_final(redis, batch)

    assert json.loads(quick["timings"])["queue_wait_s"] >= 0.1  # 38 tokens of 5 ms were still to come
    assert service.preemptions == 0 and slow["preemptions"] == "0" and slow["attempts"] == "1"


async def test_a_preempted_job_is_not_failed_by_the_attempt_limit(
    redis: Redis, start_worker: Started, model: str
) -> None:
    queue = JobQueue(redis, 3600)
    job_id = await submit(queue, model, priority=PriorityClass.batch, max_tokens=10)
    for _ in range(3):  # three preemptions before any worker of the model starts it for real
        [claim] = await queue.claim(model, "w", 1, lease_s=30)
        assert await queue.release(claim, preempted=True)

    start_worker(model, FakeEngine(0.002, 2), max_attempts=1)
    record = await wait_final(redis, job_id)

    assert record["status"] == "succeeded" and record["attempts"] == "4"


# Gateways: classes and weights from the keys file


def test_env_keys_carry_a_weight_and_a_class_ceiling() -> None:
    token = "k" * 20
    [plain, weighted] = parse_env_keys(f"a:{token},b:{token}:3:batch")

    assert (plain.weight, plain.max_class) == (1.0, "interactive")
    assert (weighted.weight, weighted.max_class) == (3.0, "batch")
    with pytest.raises(ApiKeyError, match="weight"):
        parse_env_keys(f"c:{token}:0")
    with pytest.raises(ApiKeyError, match="max class"):
        parse_env_keys(f"c:{token}:1:urgent")


async def test_a_key_limited_to_batch_cannot_submit_interactive_jobs(
    fleet: Fleet, tmp_path: Path, redis: Redis, model_name: str
) -> None:
    key_file = tmp_path / "keys.json"
    name = f"bulk-{secrets.token_hex(3)}"
    token = create_key(key_file, name, "--max-class", "batch", "--weight", "2.5")
    _, url = fleet.start_gateway(env={"ORTFLEET_API_KEYS_FILE": str(key_file)})
    fleet.start_worker(model_name)
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(token)) as client:
        refused = await client.post("/v1/jobs", json=body)
        chat = await client.post(
            "/v1/chat/completions",
            json={**body, "messages": [{"role": "user", "content": "Hi"}], "prompt": None},
        )
        job = await submit_http(client, {**body, "priority": "batch"})
        done = await wait_done(client, job["id"])

    assert refused.status_code == 403 and refused.json()["error"]["param"] == "priority"
    assert chat.status_code == 403
    assert done["status"] == "succeeded" and done["priority"] == "batch"
    record = await redis.hgetall(keys.job(job["id"]))  # type: ignore[misc]
    assert record["weight"] == "2.5" and record["owner"] == name


async def test_weights_from_the_keys_file_share_a_model_across_two_gateways(
    fleet: Fleet, tmp_path: Path, redis: Redis, model_name: str
) -> None:
    key_file = tmp_path / "keys.json"
    suffix = secrets.token_hex(3)
    heavy = create_key(key_file, f"heavy-{suffix}", "--weight", "3")
    light = create_key(key_file, f"light-{suffix}")
    env = {"ORTFLEET_API_KEYS_FILE": str(key_file)}
    _, first_url = fleet.start_gateway(env=env)
    _, second_url = fleet.start_gateway(env=env)
    worker = fleet.start_worker(model_name)
    worker.pause()
    try:
        body = {"model": model_name, "prompt": "Hi", "max_tokens": 2, "priority": "batch"}
        async with (
            httpx.AsyncClient(base_url=first_url, timeout=30, headers=bearer(heavy)) as one,
            httpx.AsyncClient(base_url=second_url, timeout=30, headers=bearer(light)) as two,
        ):
            ids = [(await submit_http(one, body))["id"] for _ in range(12)]
            ids += [(await submit_http(two, body))["id"] for _ in range(12)]
            position = (await two.get(f"/v1/jobs/{ids[12]}")).json()["queue_position"]
    finally:
        worker.resume()
    started = {}
    for job_id, token in [(i, heavy) for i in ids[:12]] + [(i, light) for i in ids[12:]]:
        async with httpx.AsyncClient(base_url=first_url, timeout=30, headers=bearer(token)) as client:
            started[job_id] = (await wait_done(client, job_id))["created_at"]
        record = await redis.hgetall(keys.job(job_id))  # type: ignore[misc]
        started[job_id] = float(record["started_at"])
    order = sorted(ids, key=started.__getitem__)
    assert position == 1  # the light key's first job waits only behind the heavy key's first
    assert sum(1 for job_id in order[:8] if job_id in ids[:12]) == 6  # 3:1 among the first eight


# A real worker process on the tiny model (the static scheduler on the CPU)


async def first_token(client: httpx.AsyncClient, job_id: str) -> None:
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        async for line in stream.aiter_lines():
            if line == "event: token":
                return


async def test_a_real_static_worker_cuts_its_batch_for_an_interactive_job_and_resumes_it_exactly(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    slow = {"ORTFLEET_STEP_DELAY_S": "0.01", "ORTFLEET_PREEMPT_AFTER_S": "0"}
    worker = fleet.start_worker(model_name, "--max-batch-size", "2", env=slow)
    batch_body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 120, "min_tokens": 120}
    reference = await wait_done(client, (await submit_http(client, batch_body))["id"])
    worker.pause()  # both batch jobs wait, so that one static batch takes them together
    try:
        batch = [(await submit_http(client, {**batch_body, "priority": "batch"}))["id"] for _ in range(2)]
    finally:
        worker.resume()
    for job_id in batch:
        await first_token(client, job_id)

    quick = await wait_done(
        client, (await submit_http(client, {**batch_body, "max_tokens": 2, "min_tokens": 0}))["id"]
    )
    finals = [await wait_done(client, job_id) for job_id in batch]

    assert quick["status"] == "succeeded"
    for job_id, final in zip(batch, finals, strict=True):
        assert final["status"] == "succeeded" and final["preemptions"] == 1, final
        assert final["attempts"] == 2 and final["output"] == reference["output"]
        assert final["created_at"] < quick["created_at"]
        events = await read_events(client, job_id)
        tokens = [e.data for e in events if e.event == "token"]
        assert "".join(t["text"] for t in tokens) == final["output"]
        indexes = [t["index"] for t in tokens]
        assert indexes == sorted(set(indexes)) and indexes[0] == 0


# Visibility


async def test_status_shows_the_waiting_jobs_per_class_and_the_keys_waiting(redis: Redis, model: str) -> None:
    queue = JobQueue(redis, 3600)
    await submit(queue, model, owner="alice")
    for _ in range(2):
        await submit(queue, model, owner="bob", priority=PriorityClass.batch)
    await redis.hset(keys.MODELS, model, "{}")  # type: ignore[misc]
    try:
        status = await read_status(redis)
    finally:
        await redis.hdel(keys.MODELS, model)  # type: ignore[misc]

    [row] = [m for m in status.models if m.name == model]
    assert row.queued == 3 and row.queued_by_class == {"interactive": 1, "batch": 2}
    assert row.waiting_keys == {"interactive:alice": 1, "batch:bob": 2}
    assert "waiting keys: batch:bob (2), interactive:alice (1)" in render(status, "redis://x")


async def test_a_queued_job_shows_its_position_and_an_eta_from_the_recent_service_rate(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    worker = fleet.start_worker(model_name)
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 2}
    for _ in range(3):
        await wait_done(client, (await submit_http(client, body))["id"])
    worker.pause()
    try:
        ids = [(await submit_http(client, body))["id"] for _ in range(2)]
        batch = (await submit_http(client, {**body, "priority": "batch"}))["id"]
        views = [(await client.get(f"/v1/jobs/{job_id}")).json() for job_id in [*ids, batch]]
        metrics = (await client.get("/metrics")).text
    finally:
        worker.resume()

    assert [v["queue_position"] for v in views] == [0, 1, 2]
    etas = [v["queue_eta_s"] for v in views]
    assert all(eta is not None and eta > 0 for eta in etas) and etas == sorted(etas)
    assert views[2]["priority"] == "batch"
    assert f'ortfleet_queued_jobs{{model="{model_name}",priority="batch"}} 1.0' in metrics
    assert f'ortfleet_served_tokens_total{{model="{model_name}",priority="interactive"}}' in metrics
