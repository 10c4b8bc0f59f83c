"""A worker's stream interval: a job's tokens go to its stream n at a time, its first and its last at once,
the tokens of one write as one entry."""

from __future__ import annotations

import asyncio

import httpx
import openai
from redis.asyncio import Redis

from common.events import entry_token_ids
from tests.conftest import Fleet, keys
from tests.fake_workers import Started
from tests.jobs_client import read_events, streamed_text, submit, wait_done
from tests.redis_events import wait_final
from tests.test_worker_fake_engine import fake_text
from tests.test_worker_fake_engine import submit as submit_to_queue
from worker.engines.fake_engine import FakeEngine

TOKENS = 23  # not a multiple of the interval: the job ends with tokens still held


def sizes(token_ids: list[list[int]]) -> list[int]:
    """How many tokens each entry carries, in order: one entry per write."""
    return [len(ids) for ids in token_ids]


def assert_grouped_by(interval: int, groups: list[int], tokens: int, early: int = 0) -> None:
    """The first token did not wait for `interval` of them (a second one may come in the same turn of
    the event loop), and all but `early` of the writes between the first and the last held at least
    `interval` tokens (another job's urgent write takes a job's held tokens along)."""
    assert sum(groups) == tokens
    assert groups[0] < interval, f"the first token waited for others: {groups}"
    short = [size for size in groups[1:-1] if size < interval]
    assert len(short) <= early, f"tokens went fewer than {interval} a write: {groups}"


async def test_four_jobs_write_their_tokens_four_at_a_time_together_and_their_last_ones_at_the_end(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    service = start_worker(model_name, FakeEngine(0.02, 4), stream_interval=4)
    prompts = ["One", "Two", "Three", "Four"]
    jobs = [await submit_to_queue(redis, model_name, prompt, max_tokens=TOKENS) for prompt in prompts]
    records = await asyncio.gather(*(wait_final(redis, job_id) for job_id in jobs))

    for prompt, job_id, record in zip(prompts, jobs, records, strict=True):
        assert record["status"] == "succeeded" and record["output"] == fake_text(prompt, TOKENS)
        tokens = [(i, f) for i, f in await redis.xrange(keys.events(job_id)) if f["type"] == "token"]
        assert "".join(fields["text"] for _i, fields in tokens) == fake_text(prompt, TOKENS)
        groups = sizes([entry_token_ids(fields) for _i, fields in tokens])
        # each entry starts where the one before ends
        assert [int(fields["index"]) for _i, fields in tokens] == [
            sum(groups[:i]) for i in range(len(groups))
        ]
        assert groups[0] == 1
        assert_grouped_by(4, groups, TOKENS, early=3)
    # Each token of each step written at once would take about 23 writes (one per step, shared by
    # the jobs); four at a time, about a quarter of that, plus the jobs' first tokens and 'running'
    # entries when they start apart.
    assert service.writer.writes <= TOKENS // 4 + 8


async def test_through_a_real_fleet_a_stream_interval_changes_when_tokens_arrive_never_what_they_say(
    fleet: Fleet, client: httpx.AsyncClient, sdk: openai.OpenAI, model_name: str
) -> None:
    steps_apart = {"ORTFLEET_STEP_DELAY_S": "0.02"}
    fleet.start_worker(model_name, env={**steps_apart, "ORTFLEET_STREAM_INTERVAL": "3"})
    each_step = model_name + "-1"
    fleet.start_worker(each_step, env=steps_apart)
    body = {"prompt": "Once upon a time", "max_tokens": TOKENS, "min_tokens": TOKENS, "temperature": 0}

    grouped = await submit(client, {**body, "model": model_name})
    events = await read_events(client, grouped["id"])
    done = await wait_done(client, grouped["id"])
    plain = await wait_done(client, (await submit(client, {**body, "model": each_step}))["id"])

    tokens = [event for event in events if event.event == "token"]
    assert_grouped_by(3, sizes([event.data["token_ids"] for event in tokens]), TOKENS)
    assert streamed_text(events) == done["output"] == plain["output"]
    assert events[-1].event == "done" and done["usage"]["completion_tokens"] == TOKENS
    # Resuming by Last-Event-ID after the second write gives the rest, each token once.
    rest = await read_events(client, grouped["id"], headers={"Last-Event-ID": tokens[1].id})
    assert streamed_text(rest) == "".join(e.data["text"] for e in tokens[2:])
    # OpenAI streaming on the same worker: every token, in order.
    chunks = sdk.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = [], None
    for chunk in chunks:
        texts += [choice.delta.content or "" for choice in chunk.choices]
        usage = chunk.usage or usage
    assert usage is not None
    unary = sdk.chat.completions.create(
        model=each_step,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=TOKENS,
        temperature=0,
    )
    assert unary.usage is not None
    assert "".join(texts) == unary.choices[0].message.content
    assert usage.completion_tokens == unary.usage.completion_tokens
