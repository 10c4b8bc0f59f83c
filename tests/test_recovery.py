"""Recovery on real processes: a job whose worker died runs alone in quarantine, so that only a poison job
is failed as poison; a job handed back resumes exactly; the chaos drill loses no job through every kind of
fault. The default model's greedy resume after a kill: tests/test_recovery_default_model.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
from redis.asyncio import Redis

from common.jobs.queue import JobQueue
from tests.conftest import Fleet, Proc, keys
from tests.jobs_client import Event, read_events, submit, wait_done
from tests.test_reliability import SLOW, assert_contiguous, stream_until_tokens

MARKER = "POISON-PILL"


def running_events(events: list[Event]) -> list[dict[str, object]]:
    return [e.data for e in events if e.event == "status" and e.data.get("status") == "running"]


async def keep_one_worker(fleet: Fleet, worker: Proc, model: str, env: dict[str, str]) -> int:
    """Starts a new worker each time the current one dies (until cancelled); returns the deaths seen."""
    deaths = 0
    try:
        while True:
            await asyncio.to_thread(worker.process.wait)
            deaths += 1
            worker = fleet.start_worker(model, wait=False, env=env)
    except asyncio.CancelledError:
        return deaths


async def queue_raw_job(redis: Redis, model: str, job_id: str) -> None:
    fields = {"id": job_id, "model": model, "status": "queued", "created_at": "1", "attempts": "0"}
    await redis.hset(keys.job(job_id), mapping=fields)
    await redis.set(keys.arq_job(job_id), "{}")
    await redis.zadd(keys.queue(model), {job_id: 1})


async def lose_worker_of(redis: Redis, model: str, job_id: str) -> None:
    """The job's lease runs out, as when its worker dies without a word."""
    await redis.zadd(keys.leases(model), {job_id: 0}, xx=True)


async def test_a_suspect_job_runs_alone_on_an_idle_worker_and_only_deaths_in_quarantine_count(
    redis: Redis,
) -> None:
    queue, model = JobQueue(redis, 600, keys), "unit-quarantine"
    for job_id in ("job_q1", "job_q2", "job_q3"):
        await queue_raw_job(redis, model, job_id)
    first = await queue.claim_jobs(model, "w1", 3, 30, idle=True)
    assert [c.quarantined for c in first.claims] == [False, False, False]
    for claim in first.claims:
        await lose_worker_of(redis, model, claim.job_id)  # w1 dies with all three

    busy = await queue.claim_jobs(model, "w2", 3, 30, idle=False)
    assert busy.claims == [] and busy.suspect_waiting  # suspects wait for a worker that runs nothing
    [alone] = (await queue.claim_jobs(model, "w3", 3, 30, idle=True)).claims
    assert alone.quarantined and alone.attempt == 2 and alone.quarantine_deaths == 0
    await lose_worker_of(redis, model, alone.job_id)  # w3 dies in quarantine: that counts
    [again] = (await queue.claim_jobs(model, "w4", 1, 30, idle=True)).claims
    record = await redis.hgetall(keys.job(again.job_id))  # type: ignore[misc]
    assert again.job_id == alone.job_id and again.quarantine_deaths == 1
    assert record["worker_deaths"] == "2" and record["quarantine_deaths"] == "1"
    await queue.release(again)  # a stopped worker hands it back: that does not count
    [back] = (await queue.claim_jobs(model, "w5", 1, 30, idle=True)).claims
    assert back.job_id == alone.job_id and back.quarantined and back.quarantine_deaths == 1
    lost = [e for _, e in await redis.xrange(keys.events(alone.job_id)) if e.get("reason") == "worker_lost"]
    assert [e["attempt"] for e in lost] == ["1", "2"]


async def test_a_poison_job_fails_after_its_quarantined_attempts_and_the_jobs_batched_with_it_succeed(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    env = {**SLOW, "ORTFLEET_MAX_ATTEMPTS": "2", "ORTFLEET_CRASH_MARKER": MARKER}
    worker = fleet.start_worker(model_name, env=env)
    worker.pause()  # the four jobs start in one batch
    try:
        innocents = [
            await submit(client, {"model": model_name, "prompt": f"Innocent {i}", "max_tokens": 60})
            for i in range(3)
        ]
        poison = await submit(client, {"model": model_name, "prompt": f"Hello {MARKER}", "max_tokens": 60})
    finally:
        worker.resume()
    keeper = asyncio.create_task(keep_one_worker(fleet, worker, model_name, env))
    try:
        failed = await wait_done(client, poison["id"], timeout_s=55)
        done = [await wait_done(client, job["id"]) for job in innocents]
    finally:
        keeper.cancel()
    deaths = await keeper

    assert failed["status"] == "failed" and failed["error_code"] == "poison"
    assert "failed as poison" in failed["error"] and "2 quarantined attempts" in failed["error"]
    assert failed["quarantine_deaths"] == 2 and failed["worker_deaths"] == 3
    assert deaths == 3  # one in the shared batch, then one per quarantined attempt
    for job in done:
        assert job["status"] == "succeeded", job
        assert job["worker_deaths"] == 1 and job["quarantine_deaths"] == 0
        assert job["engine_batch_peak"] == 1  # its quarantined attempt ran alone
        events = await read_events(client, job["id"])
        last = running_events(events)[-1]  # the first attempt died before its first write
        assert last["quarantined"] == "true" and last["attempt"] == 2
        assert any(e.data.get("reason") == "worker_lost" for e in events)
        assert len(assert_contiguous(events)) == 60
    poison_events = await read_events(client, poison["id"])
    assert poison_events[-1].event == "error" and poison_events[-1].data["code"] == "poison"


async def test_a_job_handed_back_by_a_stopped_worker_is_not_suspect(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    body = {"model": model_name, "prompt": "Hello world", "max_tokens": 200}
    leaving = fleet.start_worker(model_name, env={**SLOW, "ORTFLEET_SHUTDOWN_GRACE_S": "0.1"})
    staying = fleet.start_worker(model_name, env=SLOW)
    staying.pause()
    try:
        job = await submit(client, body)
        await stream_until_tokens(client, job["id"], 20)
        assert leaving.terminate() == 0
    finally:
        staying.resume()
    done = await wait_done(client, job["id"])
    events = await read_events(client, job["id"])
    assert done["status"] == "succeeded" and done["attempts"] == 2
    assert done["worker_deaths"] == 0 and done["quarantine_deaths"] == 0
    assert done["resumed_from"] >= 20 and done["resume_exact"] is True
    assert [r.get("quarantined") for r in running_events(events)] == [None, None]
    assert running_events(events)[1]["resumed_from"] == str(done["resumed_from"])


def test_the_chaos_drill_reports_no_lost_job_and_no_stream_defect_through_every_kind_of_fault(
    tiny_model: Path, tmp_path: Path
) -> None:
    report = tmp_path / "chaos.json"
    command = [
        *("chaos", "--model", str(tiny_model), "--jobs", "6", "--max-tokens", "60", "--workers", "2"),
        *("--worker-kills", "2", "--gateway-kills", "1", "--redis-restarts", "1", "--duration", "4"),
        *("--step-delay", "0.02", "--seed", "1", "--json", str(report)),
    ]
    finished = subprocess.run(
        [sys.executable, "-m", "ortfleet", "drill", *command], capture_output=True, text=True, timeout=280
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    figures = json.loads(report.read_text())
    summary = figures["summary"]
    assert summary["lost"] == summary["failed"] == summary["gaps"] == summary["duplicates"] == 0
    assert summary["identical"] == 6
    assert sorted(f["kind"] for f in figures["faults"]) == [
        "gateway_kill",
        "redis_restart",
        "worker_kill",
        "worker_kill",
    ]
