"""Worker logic on a real Redis with the fake engine in-process: fast tests of the job loop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from common.events import token_entry
from common.jobs.claims import Claim
from common.jobs.payload import job_payload
from common.jobs.queue import JobQueue
from common.jobs.record import RecordUpdate
from common.jobs.submission import QueueLimits
from common.registry import live_workers
from common.wire import JobSpec, Sampling
from common.worker_settings import WorkerSettings
from tests.conftest import Fleet, RedisServer, keys
from tests.fake_workers import Started, worker_info
from tests.redis_events import wait_final, wait_for_tokens
from tests.waiting import until
from worker.engines.fake_engine import FakeDecoder, FakeEngine, FakeTokenizer
from worker.service import WorkerService
from worker.static_batch import together_window


def fake_text(prompt: str, count: int) -> str:
    """What the fake engine generates after `prompt`: letters by absolute position."""
    return "".join(chr(ord("a") + (len(prompt.encode()) + i) % 26) for i in range(count))


async def submit(redis: Redis, model: str, prompt: str, **sampling: Any) -> str:
    spec = JobSpec(
        id=f"job_{time.monotonic_ns()}",
        model=model,
        prompt=prompt,
        sampling=Sampling(**sampling),
        submitted_at=time.time(),
    )
    await JobQueue(redis, 3600, keys).submit(spec, limits=QueueLimits(1000, 10**9, 0), cost=1)
    return spec.id


async def token_entries(redis: Redis, job_id: str) -> list[dict[str, str]]:
    entries = await redis.xrange(keys.events(job_id))
    return [fields for _id, fields in entries if fields["type"] == "token"]


async def test_a_job_on_the_fake_engine_streams_its_text_and_finishes_with_usage(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    start_worker(model_name)
    job_id = await submit(redis, model_name, "Hello", max_tokens=12)

    record = await wait_final(redis, job_id)

    assert record["status"] == "succeeded" and record["finish_reason"] == "length"
    assert record["output"] == fake_text("Hello", 12)
    entries = await token_entries(redis, job_id)
    assert "".join(e["text"] for e in entries) == record["output"]
    assert [int(e["index"]) for e in entries] == sorted(int(e["index"]) for e in entries)
    assert '"completion_tokens":12' in record["usage"]


async def test_min_tokens_masks_end_of_sequence(redis: Redis, start_worker: Started, model_name: str) -> None:
    start_worker(model_name, FakeEngine(0.002, 2, eos_after=3))
    early = await submit(redis, model_name, "Hi", max_tokens=10)
    fixed = await submit(redis, model_name, "Hi", max_tokens=10, min_tokens=8)

    early_record, fixed_record = await wait_final(redis, early), await wait_final(redis, fixed)

    assert early_record["output"] == fake_text("Hi", 3) and early_record["finish_reason"] == "stop"
    assert fixed_record["output"] == fake_text("Hi", 8) and fixed_record["finish_reason"] == "stop"


@pytest.mark.unit
async def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        Sampling(max_tokens=4, min_tokens=5)


async def test_the_worker_applies_stop_strings_for_a_static_engine(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    start_worker(model_name, FakeEngine(0.002, 4, continuous_batching=False))
    # After a 2-byte prompt the fake engine writes "cdefghij...".
    job_id = await submit(redis, model_name, "Hi", max_tokens=20, stop=["gh"])

    record = await wait_final(redis, job_id)

    assert record["status"] == "succeeded" and record["finish_reason"] == "stop"
    assert record["output"] == "cdef"
    assert "".join(e["text"] for e in await token_entries(redis, job_id)) == "cdef"


@pytest.mark.parametrize(
    ("stop", "text"),
    [({"stop": ["gh"]}, "cdef"), ({"stop_token_ids": [ord("h")]}, "cdefg")],
    ids=["string", "token"],
)
async def test_a_stop_found_in_the_engine_s_last_update_ends_the_job_with_the_text_before_it(
    redis: Redis, start_worker: Started, model_name: str, stop: dict[str, list[Any]], text: str
) -> None:
    start_worker(model_name, FakeEngine(0.002, 4, continuous_batching=False))
    # "cdefgh": the stop ends with the 6th token, which comes with the engine's finish (max_tokens).
    job_id = await submit(redis, model_name, "Hi", max_tokens=6, **stop)

    record = await wait_final(redis, job_id)

    assert record["status"] == "succeeded" and record["finish_reason"] == "stop"
    assert record["output"] == text


class _BreaksOnItsFifthToken(FakeDecoder):
    """Decodes like the fake tokenizer, except that the decoder of a text starting with "c" raises."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def decode(self, token_id: int) -> str:
        self.seen.append(token_id)
        if self.seen[0] == ord("c") and len(self.seen) == 5:
            raise RuntimeError("a decoder fault")
        return super().decode(token_id)


class _FaultyTokenizer(FakeTokenizer):
    def stream_decoder(self) -> FakeDecoder:
        return _BreaksOnItsFifthToken()


async def test_a_fault_in_one_job_s_token_handling_fails_that_job_and_the_batch_goes_on(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    engine = FakeEngine(0.002, 4)
    engine.tokenizer = _FaultyTokenizer()
    start_worker(model_name, engine)
    broken = await submit(redis, model_name, "Hi", max_tokens=12)  # its text starts with "c"
    sound = await submit(redis, model_name, "Hey", max_tokens=12)  # "d"

    broken_record, sound_record = await wait_final(redis, broken), await wait_final(redis, sound)

    assert broken_record["status"] == "failed"
    assert sound_record["status"] == "succeeded" and sound_record["output"] == fake_text("Hey", 12)


async def test_cancelling_a_running_job_stops_it_and_frees_its_slot(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    start_worker(model_name, FakeEngine(0.02, 1))  # one slot: the next job runs only once it is freed
    job_id = await submit(redis, model_name, "Hi", max_tokens=1000)
    await wait_for_tokens(redis, job_id, 1)

    assert await JobQueue(redis, 3600, keys).cancel(job_id, model_name) == "cancelling"
    record = await wait_final(redis, job_id)

    assert record["status"] == "cancelled" and record["finish_reason"] == "cancelled"
    assert 0 < len(record["output"]) < 1000
    after = await submit(redis, model_name, "Hi", max_tokens=2)
    assert (await wait_final(redis, after))["status"] == "succeeded"


async def test_a_resumed_job_continues_from_the_published_tokens_without_gap_or_duplicate(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    queue = JobQueue(redis, 3600, keys)
    job_id = await submit(redis, model_name, "Hello", max_tokens=10)
    [claim] = await queue.claim(model_name, "ghost", 1, 30)
    first = fake_text("Hello", 4)
    ids = [ord(c) for c in first]
    await queue.publish(
        job_id, claim.attempt, [token_entry(first, ids, 0)], RecordUpdate(first_token_at=1).to_fields()
    )
    assert await queue.release(claim)  # the ghost worker stopped: the job goes back

    start_worker(model_name)
    record = await wait_final(redis, job_id)

    assert record["status"] == "succeeded" and record["attempts"] == "2"
    assert record["output"] == fake_text("Hello", 10)
    entries = await token_entries(redis, job_id)
    assert "".join(e["text"] for e in entries) == fake_text("Hello", 10)
    indexes = [int(e["index"]) for e in entries]
    assert indexes == sorted(set(indexes)) and indexes[0] == 0
    assert '"completion_tokens":10' in record["usage"]


async def test_a_worker_whose_job_was_taken_over_frees_its_slot_at_once(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    service = start_worker(model_name, FakeEngine(0.01, 1))  # 2,000 tokens: 20 s of generation
    job_id = await submit(redis, model_name, "Hello", max_tokens=2000)
    await wait_for_tokens(redis, job_id, 3)

    await redis.hset(keys.job(job_id), "attempts", "2")  # as if another worker had claimed it
    await until(lambda: not service.runs, "the taken-over job's slot freed", 2)

    assert service.free_slots() == 1
    later = await submit(redis, model_name, "Hi", max_tokens=2)
    assert (await wait_final(redis, later))["status"] == "succeeded"


async def test_a_worker_that_lost_its_lease_never_writes_into_the_job_again(
    redis_server: RedisServer, redis: Redis, start_worker: Started, model_name: str
) -> None:
    # A worker that stalls (no heartbeat for 60 s) while its engine keeps generating.
    ghost_engine = FakeEngine(0.01, 1)
    stalled = WorkerSettings(redis_url=redis_server.url, heartbeat_ttl_s=60.0, shutdown_grace_s=0.5)
    info = worker_info(model_name, ghost_engine)
    ghost = WorkerService(stalled, redis, ghost_engine, ghost_engine.tokenizer, info, keys)
    ghost_task = asyncio.create_task(ghost.run())
    job_id = await submit(redis, model_name, "Hello", max_tokens=40)
    await wait_for_tokens(redis, job_id, 3)

    await redis.zadd(keys.leases(model_name), {job_id: 0})  # its lease runs out
    start_worker(model_name, FakeEngine(0.001, 1))
    record = await wait_final(redis, job_id)

    assert record["status"] == "succeeded" and record["attempts"] == "2"
    assert record["worker"] != ghost.info.id
    entries = await redis.xrange(keys.events(job_id))
    assert [f["type"] for _id, f in entries].count("done") == 1
    text = "".join(f.get("text", "") for _id, f in entries if f["type"] == "token")
    assert text == fake_text("Hello", 40) == record["output"]
    ghost.stop()
    await asyncio.wait_for(ghost_task, 5)
    await ghost_engine.aclose()


async def test_a_static_worker_waits_a_moment_for_the_jobs_that_will_fill_its_next_batch(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    first = [await submit(redis, model_name, "Hi", max_tokens=4) for _ in range(2)]
    start_worker(model_name, FakeEngine(0.005, 4, continuous_batching=False))
    assert [(await wait_final(redis, job))["engine_batch_peak"] for job in first] == ["2", "2"]

    # Its two clients come back a few milliseconds apart: the two jobs still run as one batch.
    again = await submit(redis, model_name, "Hi", max_tokens=4)
    await asyncio.sleep(0.005)
    later = await submit(redis, model_name, "Hi", max_tokens=4)
    records = [await wait_final(redis, job) for job in (again, later)]

    assert [r["engine_batch_peak"] for r in records] == ["2", "2"]
    assert abs(float(records[0]["started_at"]) - float(records[1]["started_at"])) < 0.05


async def test_include_stop_str_in_output_keeps_the_stop_string_on_a_continuous_engine(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    start_worker(model_name, FakeEngine(0.002, 4, continuous_batching=True))
    kept = await submit(redis, model_name, "Hi", max_tokens=20, stop=["gh"], include_stop_str_in_output=True)
    dropped = await submit(redis, model_name, "Hi", max_tokens=20, stop=["gh"])

    assert (await wait_final(redis, kept))["output"] == "cdefgh"
    assert (await wait_final(redis, dropped))["output"] == "cdef"


async def test_a_worker_process_on_the_fake_engine_ends_a_job_before_its_stop_string(
    redis: Redis, redis_server: RedisServer, model_name: str, tmp_path: Path
) -> None:
    fleet = Fleet(redis_server.url, tmp_path)  # no model folder: --fake-engine loads none
    try:
        fleet.start_worker(model_name, "--fake-engine", "2:4")
        job_id = await submit(redis, model_name, "Hi", max_tokens=20, stop=["xyz", "gh"])
        record = await wait_final(redis, job_id)
        streamed = "".join(e["text"] for e in await token_entries(redis, job_id))
    finally:
        fleet.stop_all()

    assert record["status"] == "succeeded" and record["finish_reason"] == "stop"
    assert record["output"] == streamed == "cdef"
    assert '"completion_tokens":6' in record["usage"]  # it ended with the stop's last letter, not max_tokens


async def test_a_stop_token_id_ends_the_text_before_it(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    start_worker(model_name, FakeEngine(0.002, 4))
    job_id = await submit(redis, model_name, "Hi", max_tokens=20, stop_token_ids=[ord("g")])

    record = await wait_final(redis, job_id)

    assert record["finish_reason"] == "stop" and record["output"] == "cdef"
    assert '"completion_tokens":5' in record["usage"]  # the stop token is counted, not shown


def claim_submitted_at(submitted_at: float) -> Claim:
    spec = JobSpec(id="job_window", model="m", prompt="x", sampling=Sampling(), submitted_at=submitted_at)
    return Claim("job_window", 1, job_payload(spec, 0).decode(), "m", "owner")


@pytest.mark.unit
def test_a_static_batch_waits_for_jobs_submitted_together_only_until_a_tenth_of_its_window_has_passed() -> (
    None
):
    now = 1_000.0
    assert together_window(0.02, [claim_submitted_at(now)], now) == pytest.approx(0.002)
    assert together_window(0.02, [claim_submitted_at(now - 0.0015)], now) == pytest.approx(0.0005)
    assert together_window(0.02, [claim_submitted_at(now - 5)], now) == 0  # queued long: the others too
    # The earliest of the claimed jobs counts; a clock ahead of this one's never makes it longer.
    assert together_window(0.02, [claim_submitted_at(now), claim_submitted_at(now - 1)], now) == 0
    assert together_window(0.02, [claim_submitted_at(now + 3)], now) == pytest.approx(0.002)


async def test_a_stopping_worker_leaves_the_registry_after_a_heartbeat_still_in_flight(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    service = start_worker(model_name)
    real_beat = service.heartbeat.beat
    in_flight = asyncio.Event()
    beats: list[asyncio.Task[None]] = []

    async def slow_redis_beat(ttl: float) -> None:  # a beat whose write reaches Redis late
        async def land() -> None:
            await asyncio.sleep(0.3)
            await real_beat(ttl)

        beats.append(asyncio.create_task(land()))
        in_flight.set()
        await asyncio.shield(beats[-1])  # cancelling the heartbeat does not take back a sent write

    service.heartbeat.beat = slow_redis_beat  # type: ignore[method-assign]
    await asyncio.wait_for(in_flight.wait(), 5)
    service.stop()
    await asyncio.wait_for(start_worker.run_of(service), 5)
    await asyncio.gather(*beats)
    assert not [w for w in await live_workers(redis, keys) if w["id"] == service.info.id]
