"""Batch work yields to interactive work: workers on the fake engine preempt batch jobs for waiting
interactive ones and resume them exactly, and a real worker process does the same on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from common.jobs.queue import JobQueue
from common.wire import PriorityClass
from tests.conftest import Fleet, keys
from tests.fake_workers import Started
from tests.jobs_client import read_events, wait_done
from tests.jobs_client import submit as submit_http
from tests.queued_jobs import submit
from tests.redis_events import wait_final, wait_for_tokens
from tests.test_security import bearer, create_key
from worker.engines.fake_engine import FakeEngine

# One gateway for the module's real-worker tests; each starts a worker of its own settings, on a model of
# its own, and the keyed test a gateway of its own.
pytestmark = pytest.mark.module_fleet

# Workers on the fake engine


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
    queue = JobQueue(redis, 3600, keys)
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
    queue = JobQueue(redis, 3600, keys)
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
    queue = JobQueue(redis, 3600, keys)
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
    queue = JobQueue(redis, 3600, keys)
    job_id = await submit(queue, model, priority=PriorityClass.batch, max_tokens=10)
    for _ in range(3):  # three preemptions before any worker of the model starts it for real
        [claim] = await queue.claim(model, "w", 1, lease_s=30)
        assert await queue.release(claim, preempted=True)

    start_worker(model, FakeEngine(0.002, 2), max_attempts=1)
    record = await wait_final(redis, job_id)

    assert record["status"] == "succeeded" and record["attempts"] == "4"


async def test_a_key_holding_every_slot_yields_one_to_another_keys_job_which_runs_first(
    redis: Redis, start_worker: Started, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    service = start_worker(model, FakeEngine(0.01, 2), preempt_for_keys_after_s=0.05)
    hog = []
    for prompt in ("ab", "xyz"):  # the first has the more tokens
        hog.append(await submit(queue, model, owner="alice", prompt=prompt, max_tokens=80))
        await wait_for_tokens(redis, hog[-1], 10 if prompt == "ab" else 3)

    other = await submit(queue, model, owner="bob", prompt="Hi", max_tokens=3)
    quick = await wait_final(redis, other)
    finals = [await wait_final(redis, job_id) for job_id in hog]

    assert quick["status"] == "succeeded" and quick["output"] == fake_text("Hi", 3)
    assert all(float(quick["finished_at"]) < float(r["finished_at"]) for r in finals)
    assert service.preemptions == 1
    [preempted] = [r for r in finals if r["preemptions"] == "1"]
    assert preempted["id"] == hog[1]  # the one that loses fewest tokens
    assert preempted["attempts"] == "2"
    for job_id, prompt, record in zip(hog, ("ab", "xyz"), finals, strict=True):
        assert record["status"] == "succeeded" and record["output"] == fake_text(prompt, 80)
        await assert_exact_stream(redis, job_id, prompt, 80)


async def test_slots_shared_evenly_are_not_preempted_for_another_key(
    redis: Redis, start_worker: Started, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    service = start_worker(model, FakeEngine(0.01, 2), preempt_for_keys_after_s=0.05)
    running = [await submit(queue, model, owner=f"{o}-{model}", max_tokens=40) for o in ("alice", "bob")]
    for job_id in running:
        await wait_for_tokens(redis, job_id, 2)
    third = await submit(queue, model, owner=f"carol-{model}", max_tokens=2)
    quick = await wait_final(redis, third)

    # each key holds one slot: carol's job waits for one to end, none is sent back
    assert json.loads(quick["timings"])["queue_wait_s"] >= 0.1
    assert service.preemptions == 0
    for job_id in running:
        assert (await wait_final(redis, job_id))["preemptions"] == "0"
    # a key's own jobs never preempt each other, nor does a worker told not to
    again = start_worker(model + "-off", FakeEngine(0.01, 2), preempt_for_keys=False)
    hog = [await submit(queue, model + "-off", owner="alice", max_tokens=40) for _ in range(2)]
    for job_id in hog:
        await wait_for_tokens(redis, job_id, 2)
    await wait_final(redis, await submit(queue, model + "-off", owner="bob", max_tokens=2))
    assert again.preemptions == 0


# A real worker process on the tiny model: og.Engine's static scheduler, and ortfleet's batcher


async def first_token(client: httpx.AsyncClient, job_id: str) -> None:
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        async for line in stream.aiter_lines():
            if line == "event: token":
                return


@pytest.mark.parametrize("scheduler", ["og-engine", "batcher"])
async def test_a_real_worker_cuts_batch_work_for_an_interactive_job_and_resumes_it_exactly(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str, scheduler: str
) -> None:
    slow = {"ORTFLEET_STEP_DELAY_S": "0.01", "ORTFLEET_PREEMPT_AFTER_S": "0"}
    worker = fleet.start_worker(model_name, "--max-batch-size", "2", "--scheduler", scheduler, env=slow)
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
    # The static batch is cut as a whole; the batcher frees one row, for the one interactive job.
    assert sum(final["preemptions"] for final in finals) == (2 if scheduler == "og-engine" else 1), finals
    for job_id, final in zip(batch, finals, strict=True):
        assert final["status"] == "succeeded" and final["attempts"] == 1 + final["preemptions"], final
        assert final["output"] == reference["output"]
        assert final["created_at"] < quick["created_at"]
        events = await read_events(client, job_id)
        tokens = [e.data for e in events if e.event == "token"]
        assert "".join(t["text"] for t in tokens) == final["output"]
        indexes = [t["index"] for t in tokens]
        assert indexes == sorted(set(indexes)) and indexes[0] == 0


async def test_on_the_batcher_a_preempted_structured_output_job_resumes_through_its_grammar(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    slow = {"ORTFLEET_STEP_DELAY_S": "0.01", "ORTFLEET_PREEMPT_AFTER_S": "0"}
    fleet.start_worker(model_name, "--max-batch-size", "1", "--scheduler", "batcher", env=slow)
    schema = {
        "type": "object",
        "properties": {"story": {"type": "string", "maxLength": 120}},
        "required": ["story"],
        "additionalProperties": False,
    }
    guided = {
        "model": model_name,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    reference = await wait_done(client, (await submit_http(client, guided))["id"])
    job_id = (await submit_http(client, {**guided, "priority": "batch"}))["id"]
    await first_token(client, job_id)
    quick_body = {"model": model_name, "prompt": "Hi", "max_tokens": 2}
    quick = await wait_done(client, (await submit_http(client, quick_body))["id"])
    final = await wait_done(client, job_id)

    assert quick["status"] == "succeeded"
    assert final["status"] == "succeeded" and final["preemptions"] == 1 and final["attempts"] == 2, final
    assert final["output"] == reference["output"]  # the grammar went on from the replayed tokens
    assert set(json.loads(final["output"])) == {"story"}


async def test_a_real_worker_makes_room_for_another_keys_chat_when_one_key_holds_every_row(
    fleet: Fleet, model_name: str, tmp_path: Path
) -> None:
    key_file = tmp_path / "keys.json"
    alice, bob = (bearer(create_key(key_file, name)) for name in ("alice", "bob"))
    _, url = fleet.start_gateway({"ORTFLEET_API_KEYS_FILE": str(key_file)})
    slow = {"ORTFLEET_STEP_DELAY_S": "0.01", "ORTFLEET_PREEMPT_FOR_KEYS_AFTER_S": "0.2"}
    fleet.start_worker(model_name, "--max-batch-size", "2", "--scheduler", "batcher", env=slow)
    long_body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 150, "min_tokens": 150}
    async with (
        httpx.AsyncClient(base_url=url, headers=alice, timeout=60) as hog,
        httpx.AsyncClient(base_url=url, headers=bob, timeout=60) as other,
    ):
        reference = await wait_done(hog, (await submit_http(hog, long_body))["id"])
        held = [(await submit_http(hog, long_body))["id"] for _ in range(2)]
        for job_id in held:
            await first_token(hog, job_id)
        quick = await wait_done(
            other, (await submit_http(other, {**long_body, "max_tokens": 2, "min_tokens": 0}))["id"]
        )
        finals = [await wait_done(hog, job_id) for job_id in held]

    assert quick["status"] == "succeeded"

    def ended(job: dict[str, Any]) -> float:
        return float(job["created_at"]) + float(job["timings"]["total_s"])

    assert all(ended(quick) < ended(final) for final in finals)
    assert [final["preemptions"] for final in finals] == [0, 1]  # the later started gave way
    for final in finals:
        assert final["status"] == "succeeded" and final["output"] == reference["output"]  # exact resume
