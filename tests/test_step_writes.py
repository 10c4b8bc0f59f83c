"""A worker writes all of its running jobs' new entries of one engine step in one Redis call."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import orjson
import pytest
from redis.asyncio import Redis

from common import aio
from common.events import token_entry
from common.jobs.queue import JobQueue
from common.jobs.writes import StepResult, StepWrite
from common.redis_client import REPLY_WAIT_S, HeldConnection, connect
from ortfleet.bench.machine import wakeups
from tests.conftest import RedisServer, keys
from tests.fake_workers import Started
from tests.redis_events import fresh_jobs, wait_final
from tests.test_worker_fake_engine import fake_text, submit, token_entries
from worker.engines.fake_engine import FakeEngine
from worker.publisher import LeaseLost, StepWriter, StreamPublisher

TOKENS = 24


async def test_four_jobs_in_one_batch_cost_one_write_per_engine_step_not_one_per_job(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    engine = FakeEngine(0.01, 4)
    service = start_worker(model_name, engine)
    prompts = ["One", "Two", "Three", "Four"]
    jobs = [await submit(redis, model_name, prompt, max_tokens=TOKENS) for prompt in prompts]
    records = await asyncio.gather(*(wait_final(redis, job_id) for job_id in jobs))

    for prompt, job_id, record in zip(prompts, jobs, records, strict=True):
        assert record["status"] == "succeeded" and record["output"] == fake_text(prompt, TOKENS)
        entries = await token_entries(redis, job_id)
        assert "".join(entry["text"] for entry in entries) == fake_text(prompt, TOKENS)
        assert entries[0]["index"] == "0" and "first_token_at" in record
    # One write per job per step would be 4 x 24 = 96 writes; shared, about one per step (24), plus
    # a few for the jobs' 'running' entries when they start apart.
    assert service.writer.writes <= TOKENS + 8


async def test_a_step_write_skips_a_job_whose_attempt_lost_it_and_writes_the_others(redis: Redis) -> None:
    queue = JobQueue(redis, 3600, keys)
    kept, lost = "job_step_kept", "job_step_lost"
    await fresh_jobs(redis, kept, lost, attempt=2)
    writes = [
        StepWrite(kept, 2, [token_entry("a", [97], 0), token_entry("b", [98], 1)], {"first_token_at": "1"}),
        StepWrite(lost, 1, [token_entry("x", [120], 0)], {"first_token_at": "1"}),
    ]

    assert await queue.publish_step(writes) == [True, False]

    assert [fields["text"] for _id, fields in await redis.xrange(keys.events(kept))] == ["a", "b"]
    assert await redis.hget(keys.job(kept), "first_token_at") == "1"
    assert await redis.xlen(keys.events(lost)) == 0
    assert await redis.hget(keys.job(lost), "first_token_at") is None


class HeldFor(JobQueue):
    """Writes that carry `job_id`'s entries are held until `release` is set."""

    def __init__(self, redis: Redis, job_id: str) -> None:
        super().__init__(redis, 3600, keys)
        self.job_id = job_id
        self.held, self.release = asyncio.Event(), asyncio.Event()

    async def publish_step(
        self, writes: list[StepWrite], reply_after: asyncio.Event | None = None
    ) -> list[StepResult]:
        if any(write.job_id == self.job_id for write in writes):
            self.held.set()
            await self.release.wait()
        return await super().publish_step(writes, reply_after)


async def test_a_jobs_first_token_never_waits_for_another_jobs_write_in_flight(redis: Redis) -> None:
    slow, fresh = "job_step_slow", "job_step_fresh"
    await fresh_jobs(redis, slow, fresh)
    queue = HeldFor(redis, slow)
    writer = StepWriter(queue, 64)
    busy, first = writer.publisher(slow, 1), writer.publisher(fresh, 1)
    busy.add(token_entry("a", [97], 0))
    await asyncio.wait_for(queue.held.wait(), 1.0)  # the slow job's write is out
    first.add(token_entry("b", [98], 0))
    await asyncio.wait_for(first.drain(), 1.0)  # while the slow write is still out
    assert await redis.xlen(keys.events(fresh)) == 1 and await redis.xlen(keys.events(slow)) == 0
    queue.release.set()
    await asyncio.wait_for(busy.drain(), 5.0)
    assert await redis.xlen(keys.events(slow)) == 1
    await writer.close()


async def test_step_writes_go_on_when_redis_forgets_its_scripts_or_closes_the_writers_connection(
    redis: Redis,
) -> None:
    queue = JobQueue(redis, 3600, keys)
    job_id = "job_step_held"
    await fresh_jobs(redis, job_id)

    def write(index: int) -> list[StepWrite]:
        return [StepWrite(job_id, 1, [token_entry(str(index), [index], index)], {})]

    assert await queue.publish_step(write(0)) == [StepResult.written]
    await redis.script_flush()  # as after a restart without persistence
    assert await queue.publish_step(write(1)) == [StepResult.written]
    writers = [c for c in await redis.client_list() if c["cmd"] == "evalsha"]
    assert len(writers) == 1  # the step writes' own connection
    await redis.client_kill_filter(_id=writers[0]["id"])
    assert await queue.publish_step(write(2)) == [StepResult.written]
    texts = [fields["text"] for _id, fields in await redis.xrange(keys.events(job_id))]
    assert texts == ["0", "1", "2"]


async def test_step_writes_sent_while_another_is_out_each_reach_their_own_stream(redis: Redis) -> None:
    # A job's first token is written at once, beside the step write in flight (StepWriter's solo
    # write): the calls overlap, and each must get its own reply.
    queue = JobQueue(redis, 3600, keys)
    opener, *jobs = [f"job_step_overlap_{n}" for n in range(5)]
    await fresh_jobs(redis, opener, *jobs)

    def write(job_id: str, index: int) -> list[StepWrite]:
        return [StepWrite(job_id, 1, [token_entry(f"{job_id}:{index}", [index], index)], {})]

    assert await queue.publish_step(write(opener, 0)) == [StepResult.written]  # its connection is open
    overlapping = await asyncio.gather(*(queue.publish_step(write(job_id, 0)) for job_id in jobs))
    assert overlapping == [[StepResult.written]] * len(jobs)
    for job_id in jobs:  # and one after another again
        assert await queue.publish_step(write(job_id, 1)) == [StepResult.written]
    for job_id in jobs:
        texts = [fields["text"] for _id, fields in await redis.xrange(keys.events(job_id))]
        assert texts == [f"{job_id}:0", f"{job_id}:1"]


class FailsOnce(JobQueue):
    """Its first step write fails with a fault of the worker's own (not Redis')."""

    def __init__(self, redis: Redis) -> None:
        super().__init__(redis, 3600, keys)
        self.failures = 0

    async def publish_step(
        self, writes: list[StepWrite], reply_after: asyncio.Event | None = None
    ) -> list[StepResult]:
        if not self.failures:
            self.failures += 1
            raise RuntimeError("a fault of the worker's own")
        return await super().publish_step(writes, reply_after)


async def test_a_step_write_that_fails_for_a_fault_of_the_worker_is_tried_again(redis: Redis) -> None:
    job_id = "job_step_fault"
    await fresh_jobs(redis, job_id)
    queue = FailsOnce(redis)
    writer = StepWriter(queue, 64)
    publisher = writer.publisher(job_id, 1)
    publisher.add(token_entry("a", [97], 0))
    await asyncio.wait_for(publisher.drain(), 5)
    assert queue.failures == 1
    assert [fields["text"] for _id, fields in await redis.xrange(keys.events(job_id))] == ["a"]
    await writer.close()


class NeverAnswers(JobQueue):
    def __init__(self, redis: Redis) -> None:
        super().__init__(redis, 3600, keys)
        self.write_out = asyncio.Event()

    async def publish_step(
        self, writes: list[StepWrite], reply_after: asyncio.Event | None = None
    ) -> list[StepResult]:
        self.write_out.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_once_the_writer_is_closed_no_job_waits_for_its_unwritten_entries(redis: Redis) -> None:
    queue = NeverAnswers(redis)
    writer = StepWriter(queue, 64)
    out, later = writer.publisher("job_step_out", 1), writer.publisher("job_step_later", 1)
    out.add(token_entry("a", [97], 0))
    await asyncio.wait_for(queue.write_out.wait(), 1.0)  # its write is out, and never answered
    await writer.close()
    later.add(token_entry("b", [98], 0))
    await asyncio.wait_for(asyncio.gather(out.close(), later.close()), 1.0)


STEPS = 40


async def _steps_on_their_own_loop(url: str, job_ids: list[str]) -> int:
    """Four jobs' tokens written by a StepWriter for STEPS engine steps of 20 ms each; how many times the
    loop's thread was woken meanwhile. The steps come on the loop's timer, which wakes the loop once a
    step as the engine's hand-over does (an engine thread of Python's own would add wake-ups of its
    own, for the GIL)."""
    redis = connect(url)
    writer = StepWriter(JobQueue(redis, 3600, keys), 64)
    publishers = [writer.publisher(job_id, 1) for job_id in job_ids]
    for publisher in publishers:  # each job's first token goes out at once, on its own
        publisher.add(token_entry("0", [0], 0))
    await asyncio.gather(*(publisher.drain() for publisher in publishers))
    loop, done = asyncio.get_running_loop(), asyncio.Event()

    def step(index: int) -> None:
        for publisher in publishers:
            publisher.add(token_entry(str(index), [index], index))
        if index == STEPS:
            done.set()
        else:
            loop.call_later(0.02, step, index + 1)

    woken_before = wakeups(os.getpid(), threading.get_native_id())
    loop.call_later(0.02, step, 1)
    await done.wait()
    woken = wakeups(os.getpid(), threading.get_native_id()) - woken_before
    await asyncio.gather(*(publisher.close() for publisher in publishers))
    await writer.close()
    await redis.aclose()
    return woken


async def test_a_workers_loop_is_woken_once_per_engine_step_not_again_for_each_writes_reply(
    redis: Redis, redis_server: RedisServer
) -> None:
    job_ids = [f"job_step_woken_{n}" for n in range(4)]
    await fresh_jobs(redis, *job_ids)
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(aio.run(_steps_on_their_own_loop(redis_server.url, job_ids)))
    )
    thread.start()
    await asyncio.to_thread(thread.join)

    # Once per step for its tokens; reading each write's reply as it came would double that.
    assert result[0] <= STEPS + 8
    for job_id in job_ids:
        texts = [entry["text"] for entry in await token_entries(redis, job_id)]
        assert texts == [str(index) for index in range(STEPS + 1)]


async def second_token_written(redis: Redis, job_id: str) -> tuple[StepWriter, StreamPublisher]:
    """A job's writer and publisher once its first token is in its stream, and its second token too,
    by a plain step write whose reply is left in the socket for the next write."""
    await fresh_jobs(redis, job_id)
    writer = StepWriter(JobQueue(redis, 3600, keys), 64)
    publisher = writer.publisher(job_id, 1)
    publisher.add(token_entry("0", [0], 0))
    await publisher.drain()
    [(first, _fields)] = await redis.xrange(keys.events(job_id))
    publisher.add(token_entry("1", [1], 1))
    assert await redis.xread({keys.events(job_id): first}, block=5000)
    return writer, publisher


async def test_a_job_taken_over_stops_its_writes_though_their_replies_are_read_a_step_later(
    redis: Redis,
) -> None:
    job_id = "job_step_taken_over"
    writer, publisher = await second_token_written(redis, job_id)
    await redis.hset(keys.job(job_id), "attempts", "2")  # another worker took the job over
    publisher.add(token_entry("2", [2], 2))
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(publisher.drain(), 5)
    assert publisher.lost
    publisher.add(token_entry("3", [3], 3))  # nothing more is written for it
    await publisher.close()
    await writer.close()
    assert [entry["text"] for entry in await token_entries(redis, job_id)] == ["0", "1"]


async def test_a_held_connection_reads_a_reply_once_asked_or_after_its_longest_wait(redis: Redis) -> None:
    held = HeldConnection(redis)
    script = redis.register_script("return redis.call('XADD', KEYS[1], '*', 'n', ARGV[1])")
    await redis.delete("held_stream")
    first = await held.run_script(script, ["held_stream"], ["1"])
    asked = asyncio.Event()
    call = asyncio.create_task(held.run_script(script, ["held_stream"], ["2"], reply_after=asked))
    [[_key, [(written, fields)]]] = await redis.xread({"held_stream": first}, block=5000)
    assert fields == {"n": "2"} and not call.done()  # it ran at once; its reply waits
    asked.set()
    assert await asyncio.wait_for(call, 1) == written
    # Never asked: read after REPLY_WAIT_S.
    started = time.monotonic()
    assert await held.run_script(script, ["held_stream"], ["3"], reply_after=asyncio.Event())
    assert time.monotonic() - started >= REPLY_WAIT_S * 0.9


async def test_step_writes_go_on_when_redis_closes_the_connection_while_a_reply_waits(redis: Redis) -> None:
    job_id = "job_step_closed_waiting"
    writer, publisher = await second_token_written(redis, job_id)
    writers = [c for c in await redis.client_list() if c["cmd"] == "evalsha"]
    await redis.client_kill_filter(_id=writers[0]["id"])
    publisher.add(token_entry("2", [2], 2))
    await asyncio.wait_for(publisher.drain(), 5)
    await publisher.close()
    await writer.close()
    # The write whose reply was lost is sent again: a reader skips the entry it already has (by index).
    indexes = [int(entry["index"]) for entry in await token_entries(redis, job_id)]
    assert sorted(set(indexes)) == [0, 1, 2] and indexes == sorted(indexes)


async def test_a_step_writes_notice_names_the_entry_before_its_own_whichever_script_added_it(
    redis: Redis, model_name: str
) -> None:
    job_id = await submit(redis, model_name, "Hello", max_tokens=4)  # submit.lua adds the first entry
    queue = JobQueue(redis, 3600, keys)
    await redis.hset(keys.job(job_id), "attempts", "1")  # as a claim leaves it
    notices = redis.pubsub()
    await notices.subscribe(keys.stream_notices)
    await notices.get_message(timeout=5)  # the subscription's confirmation
    try:
        for index in range(2):
            await queue.publish_step([StepWrite(job_id, 1, [token_entry("a", [97], index)], {})])
            message = await notices.get_message(timeout=5)
            assert message is not None
            _names, _, carried = message["data"].partition("\n")
            [(stream, after, added)] = orjson.loads(carried)
            ids = [entry_id for entry_id, _fields in await redis.xrange(keys.events(job_id))]
            assert stream == keys.events(job_id) and after == ids[-2] and [added[0][0]] == ids[-1:]
            assert await redis.hget(keys.job(job_id), "tail") == ids[-1]
    finally:
        await notices.aclose()
