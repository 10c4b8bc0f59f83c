"""Keys share a worker's rows: a key above its share yields a row to another key's waiting job wherever
that job stands in the queue, the freed row goes to that job, and no job of the key is preempted again
and again. The choice alone, workers on the fake engine, and a real worker process on the tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from common.jobs.cancellation import CancelOutcome
from common.jobs.queue import JobQueue
from common.jobs.reads import WaitingJob
from tests.conftest import Fleet, keys
from tests.fake_workers import Started
from tests.jobs_client import submit as submit_http
from tests.jobs_client import wait_done
from tests.queued_jobs import submit
from tests.redis_events import wait_final, wait_for_tokens
from tests.test_batch_preemption import assert_exact_stream, fake_text, first_token
from tests.test_security import bearer, create_key
from worker.engines.fake_engine import FakeEngine
from worker.row_shares import Row, handover, shares

# The choice of a row to yield


def row(job_id: str, owner: str, *, preemptions: int = 0, lost: int = 100, weight: float = 1.0) -> Row:
    return Row(job_id, owner, weight, preemptions, lost, started_at=0.0)


def never(_row: Row) -> bool:
    return False


@pytest.mark.unit
def test_a_keys_share_of_the_rows_follows_its_weight() -> None:
    assert shares(8, {"alice": 1.0, "bob": 1.0}) == {"alice": 4.0, "bob": 4.0}
    assert shares(8, {"alice": 3.0, "bob": 1.0}) == {"alice": 6.0, "bob": 2.0}


@pytest.mark.unit
def test_a_key_above_its_share_yields_the_row_preempted_fewest_times_then_the_one_that_loses_least() -> None:
    rows = [
        row("a1", "alice", preemptions=1, lost=10),
        row("a2", "alice", lost=300),
        row("a3", "alice", lost=50),
    ]
    rows.append(row("b1", "bob"))
    waiting = [WaitingJob("a4", "alice", 1.0), WaitingJob("b2", "bob", 1.0), WaitingJob("b3", "bob", 1.0)]

    choice = handover(rows, waiting, 4, never)

    # alice holds 3 of 4 rows, her share is 2: her job behind her own queued one gets a row
    assert choice is not None and choice.row.job_id == "a3" and choice.job.id == "b2"
    assert choice.eligible == 1  # bob, with one row, has room for one more within his share
    protected = handover(rows, waiting, 4, lambda r: r.job_id == "a3")
    assert protected is not None and protected.row.job_id == "a2"
    assert handover(rows, waiting, 4, lambda r: r.owner == "alice") is None


@pytest.mark.unit
def test_keys_within_their_shares_yield_nothing() -> None:
    even = [row("a1", "alice"), row("b1", "bob")]
    assert handover(even, [WaitingJob("c1", "carol", 1.0)], 2, never) is None  # 2 rows, 3 keys
    assert handover(even, [WaitingJob("b2", "bob", 1.0)], 2, never) is None
    heavy = [row(f"a{i}", "alice", weight=3.0) for i in range(4)]
    assert handover(heavy, [WaitingJob("b1", "bob", 1.0)], 4, never) is not None  # alice's share is 3
    assert handover(heavy, [WaitingJob("b1", "bob", 0.2)], 4, never) is None  # bob's share is 0.25


# Workers on the fake engine


async def test_another_keys_job_gets_a_row_even_when_the_holding_keys_own_job_waits_at_the_head(
    redis: Redis, start_worker: Started, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    # bob's earlier job spent his fair share of tokens: his next one queues behind alice's
    spent = await submit(queue, model, owner="bob", cost=10_000)
    assert await queue.cancel(spent, model) is CancelOutcome.cancelled
    service = start_worker(model, FakeEngine(0.01, 2), preempt_for_keys_after_s=0.05)
    hog = [await submit(queue, model, owner="alice", prompt=p, max_tokens=80) for p in ("ab", "xyz", "late")]
    for job_id in hog[:2]:
        await wait_for_tokens(redis, job_id, 3)

    other = await submit(queue, model, owner="bob", prompt="Hi", max_tokens=3)
    assert await redis.zrange(keys.queue(model, "interactive"), 0, -1) == [hog[2], other]
    quick = await wait_final(redis, other)
    finals = [await wait_final(redis, job_id) for job_id in hog]

    assert quick["status"] == "succeeded" and quick["output"] == fake_text("Hi", 3)
    assert all(float(quick["finished_at"]) < float(r["finished_at"]) for r in finals)
    assert float(quick["started_at"]) < float(finals[2]["started_at"])  # the freed row went to bob's job
    assert service.preemptions == 1
    for job_id, prompt, record in zip(hog, ("ab", "xyz", "late"), finals, strict=True):
        assert record["status"] == "succeeded" and record["output"] == fake_text(prompt, 80)
        await assert_exact_stream(redis, job_id, prompt, 80)


async def test_rows_given_to_another_keys_jobs_one_after_another_come_from_different_jobs(
    redis: Redis, start_worker: Started, model: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    service = start_worker(model, FakeEngine(0.01, 4), preempt_for_keys_after_s=0.05)
    prompts = [f"story {i}" for i in range(6)]
    hog = [await submit(queue, model, owner="alice", prompt=p, max_tokens=300) for p in prompts]
    for job_id in hog[:4]:
        await wait_for_tokens(redis, job_id, 2)

    quick = []
    for k in range(4):  # one after another: each finds alice on every row again
        quick.append(await wait_final(redis, await submit(queue, model, owner="bob", prompt=f"Hi {k}")))
    finals = [await wait_final(redis, job_id, 30) for job_id in hog]

    assert all(q["status"] == "succeeded" for q in quick)
    assert max(float(q["finished_at"]) for q in quick) < min(float(r["finished_at"]) for r in finals)
    preemptions = [int(r["preemptions"]) for r in finals]
    assert service.preemptions == sum(preemptions) >= 3
    assert max(preemptions) == 1  # never the job that resumed from the last preemption
    for job_id, prompt, record in zip(hog, prompts, finals, strict=True):
        assert record["status"] == "succeeded" and record["output"] == fake_text(prompt, 300)
        await assert_exact_stream(redis, job_id, prompt, 300)


# A real worker process on the tiny model, behind a gateway with two keys


async def test_a_real_worker_gives_another_keys_chats_a_row_soon_while_one_key_runs_more_jobs_than_rows(
    fleet: Fleet, model_name: str, tmp_path: Path
) -> None:
    key_file = tmp_path / "keys.json"
    alice, bob = (bearer(create_key(key_file, name)) for name in ("alice", "bob"))
    _, url = fleet.start_gateway({"ORTFLEET_API_KEYS_FILE": str(key_file)})
    env = {
        "ORTFLEET_MAX_BATCH_SIZE": "4",
        "ORTFLEET_STEP_DELAY_S": "0.02",
        "ORTFLEET_PREEMPT_FOR_KEYS_AFTER_S": "0.5",
    }
    fleet.start_worker(model_name, "--scheduler", "batcher", env=env)
    long_body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 250, "min_tokens": 250}
    async with (
        httpx.AsyncClient(base_url=url, headers=alice, timeout=60) as hog,
        httpx.AsyncClient(base_url=url, headers=bob, timeout=60) as other,
    ):
        held = [(await submit_http(hog, long_body))["id"] for _ in range(8)]  # 8 jobs, 4 rows
        for job_id in held[:4]:
            await first_token(hog, job_id)
        # bob's earlier job spent his fair share of tokens: his next ones queue behind alice's
        spent = (await submit_http(other, {**long_body, "max_tokens": 450, "min_tokens": 0}))["id"]
        assert (await other.delete(f"/v1/jobs/{spent}")).json()["status"] == "cancelled"

        quick: list[dict[str, Any]] = []
        for k in range(3):  # one after another
            job = await submit_http(other, {"model": model_name, "prompt": f"Hi {k}", "max_tokens": 2})
            if k == 0:
                assert (await other.get(f"/v1/jobs/{job['id']}")).json()["queue_position"] >= 1
            quick.append(await wait_done(other, job["id"]))
        finals = [await wait_done(hog, job_id) for job_id in held]

    assert all(q["status"] == "succeeded" for q in quick), quick
    longest_wait = max(q["timings"]["ttft_s"] for q in quick)
    assert longest_wait < min(final["timings"]["total_s"] for final in finals) / 2, (quick, finals)
    preemptions = [final["preemptions"] for final in finals]
    assert 1 <= sum(preemptions) and max(preemptions) == 1, preemptions
    assert all(final["status"] == "succeeded" for final in finals), finals
    assert len({final["output"] for final in finals}) == 1  # the preempted resumed exactly
    assert all(final["usage"]["completion_tokens"] == 250 for final in finals)
