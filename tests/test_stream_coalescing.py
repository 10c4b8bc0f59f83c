"""Coalescing: at a high token rate a job's tokens go to its stream a few steps at a time, as one entry,
its first at once; at a low rate every step's tokens go out as they come."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from common.events import entry_token_ids, merge_token_entries, status_entry, token_entry
from common.jobs.queue import JobQueue
from common.wire import JobStatus
from tests.conftest import keys
from tests.fake_workers import Started
from tests.redis_events import fresh_jobs, lose_newest_tokens, wait_final
from tests.test_worker_fake_engine import fake_text, submit, token_entries
from worker.engines.fake_engine import FakeEngine
from worker.publisher import StepWriter


def _logprob(token: str) -> dict[str, object]:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


@pytest.mark.unit
def test_consecutive_token_entries_become_one_with_the_same_text_and_ids() -> None:
    entries = [
        token_entry("He", [10], 0),
        token_entry("llo", [11, 12], 1),
        token_entry("", [], 3),  # a held-back text's tail: no tokens
        status_entry(JobStatus.running),
        token_entry("!", [13], 3),
        token_entry("?", [14], 9),  # does not start where the one before ends
    ]
    given = [dict(entry) for entry in entries]

    merged = merge_token_entries(entries)

    assert entries == given  # the caller's entries are left as they were
    assert [entry.get("index") for entry in merged] == ["0", None, "3", "9"]
    assert merged[0]["text"] == "Hello" and entry_token_ids(merged[0]) == [10, 11, 12]
    assert merged[2] is entries[4] and merged[3] is entries[5]  # alone: the entry itself


@pytest.mark.unit
def test_entries_with_logprobs_stay_apart() -> None:
    """Each is large already: joined, they would pass the size a stream packs its entries in."""
    entries = [
        token_entry("a", [1], 0, [_logprob("a")]),
        token_entry("b", [2], 1, [_logprob("b")]),
        token_entry("c", [3], 2),
    ]
    assert merge_token_entries(entries) == entries


async def test_at_a_high_token_rate_a_jobs_tokens_go_several_steps_at_a_time_its_first_at_once(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    # 32 rows every 4 ms: up to 8,000 token entries a second, far above the 400 job writes a second set
    # here: a job's tokens wait up to 32 / 400 = 80 ms, at most 60.
    start_worker(model_name, FakeEngine(0.004, 32), stream_coalesce_ms=60, stream_writes_per_s=400)
    tokens = 200
    prompts = [f"Job {i}" for i in range(32)]
    jobs = [await submit(redis, model_name, prompt, max_tokens=tokens) for prompt in prompts]
    records = await asyncio.gather(*(wait_final(redis, job_id, timeout_s=120) for job_id in jobs))

    carried = []
    for prompt, job_id, record in zip(prompts, jobs, records, strict=True):
        assert record["status"] == "succeeded" and record["output"] == fake_text(prompt, tokens)
        entries = await token_entries(redis, job_id)
        assert "".join(entry["text"] for entry in entries) == fake_text(prompt, tokens)
        sizes = [len(entry_token_ids(entry)) for entry in entries]
        # each entry starts where the one before ends, every token once
        assert [int(entry["index"]) for entry in entries] == [sum(sizes[:i]) for i in range(len(sizes))]
        assert sum(sizes) == tokens
        carried += sizes[1:]
    # Once the writer has seen the rate (0.2 s), tokens wait up to 60 ms: most go several to an entry,
    # where without coalescing each entry would carry one step's token.
    together = sum(size for size in carried if size >= 3)
    assert together >= 0.6 * sum(carried), carried


async def test_at_a_low_token_rate_every_steps_token_goes_out_as_it_comes(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    # One row every 5 ms: at most 200 token entries a second, below the 2,000 set here.
    service = start_worker(model_name, FakeEngine(0.005, 4), stream_coalesce_ms=60, stream_writes_per_s=2000)
    job_id = await submit(redis, model_name, "Alone", max_tokens=120)
    record = await wait_final(redis, job_id)

    assert record["status"] == "succeeded" and not service.writer.coalescing
    entries = await token_entries(redis, job_id)
    assert [int(entry["index"]) for entry in entries] == list(range(120))


async def test_entries_a_failover_lost_are_written_again_as_they_were_not_merged_with_new_ones(
    redis: Redis,
) -> None:
    job_id = "job_coalesced_gap"
    await fresh_jobs(redis, job_id)
    writer = StepWriter(
        JobQueue(redis, 3600, keys), 64, 2
    )  # a stream interval: a write's tokens are one entry
    publisher = writer.publisher(job_id, 1)
    publisher.add(token_entry("a", [0], 0))
    await publisher.drain()
    for first in (1, 3):  # two writes of two tokens each: [1, 2] and [3, 4]
        publisher.add(token_entry(chr(97 + first), [first], first))
        publisher.add(token_entry(chr(98 + first), [first + 1], first + 1))
        await publisher.drain()
    await lose_newest_tokens(redis, job_id, 3)  # [3, 4] lost; a reader may have had it

    publisher.add(token_entry("f", [5], 5))
    publisher.add(token_entry("g", [6], 6))
    await publisher.drain()

    stream = [fields for _id, fields in await redis.xrange(keys.events(job_id))]
    assert [entry_token_ids(fields) for fields in stream] == [[0], [1, 2], [3, 4], [5, 6]]
    assert "".join(fields["text"] for fields in stream) == "abcdefg"
    await writer.close()


async def test_while_coalescing_tokens_join_the_pending_entry_but_never_one_a_write_has_taken(
    redis: Redis,
) -> None:
    job_id = "job_joined_on_add"
    await fresh_jobs(redis, job_id)
    writer = StepWriter(JobQueue(redis, 3600, keys), 64, max_wait_s=1.0, writes_per_s=1.0)
    writer.wait_s = 1.0  # coalescing from the start (the writer measures the rate only after 0.2 s)
    publisher = writer.publisher(job_id, 1)
    publisher.add_tokens("a", [0], 0)
    await publisher.drain()
    publisher.add_tokens("b", [1], 1)
    publisher.add_tokens("c", [2], 2)
    publisher.add_tokens("", [], 3)  # a stop string's held text: no token
    assert [entry["ids"] for entry in publisher.pending] == ["1,2"]  # joined as they came

    publisher.add_tokens("d", [3], 3)
    await redis.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")  # holds the next write in flight
    draining = asyncio.create_task(publisher.drain())
    while not publisher.in_flight:  # noqa: ASYNC110  (the writer's task takes the entries within a yield or two)
        await asyncio.sleep(0)
    publisher.add_tokens("e", [4], 4)  # the write in flight took "bcd": this one waits apart
    publisher.add_tokens("f", [5, 6], 5, record={"first_token_at": "1"})  # a record: an entry of its own
    publisher.add_tokens("g", [7], 7)  # joins "f": no write has taken it
    assert [entry["ids"] for entry in publisher.pending] == ["1,2,3", "4", "5,6,7"]
    await redis.execute_command("CLIENT", "UNPAUSE")
    await draining
    await publisher.drain()

    stream = [fields for _id, fields in await redis.xrange(keys.events(job_id))]
    assert [entry_token_ids(fields) for fields in stream] == [[0], [1, 2, 3], [4, 5, 6, 7]]
    assert "".join(fields["text"] for fields in stream) == "abcdefg"
    await writer.close()
