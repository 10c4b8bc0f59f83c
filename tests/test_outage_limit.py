"""A Redis that goes away: every reader of a job's tokens waits for it for ORTFLEET_STORE_OUTAGE_LIMIT_S,
goes on losing nothing when it is back within it, and else ends with `store_unavailable`: OpenAI streams
with an error chunk and [DONE], waiting OpenAI calls and long-polls with 503, job streams with an `error`
event. Each fleet here sets a short limit."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from redis import Redis as SyncRedis

from tests.conftest import Fleet, RedisServer, keys
from tests.jobs_client import Event, read_events, streamed_text, submit, wait_done
from tests.waiting import until

SLOW = {"ORTFLEET_STEP_DELAY_S": "0.05"}  # about 20 tokens/s: the jobs still run when Redis goes
LIMIT_S = 3.0
MARGIN_S = 7.0  # room for a busy machine: the old code waited without end
CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 300, "ignore_eos": True}
JOB = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}


async def read_chat_stream(
    client: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event, job_ids: list[str] | None = None
) -> list[str]:
    """The data of every event of a streamed chat, up to its end; `started` is set at its first one, after
    its job's id went into `job_ids`."""
    datas: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, await reply.aread()
        if job_ids is not None:
            job_ids.append(reply.headers["X-Ortfleet-Job-Id"])
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                datas.append(line.removeprefix("data: "))
                started.set()
    return datas


async def sdk_chat_stream(sdk: openai.AsyncOpenAI, model: str, started: asyncio.Event) -> openai.APIError:
    """The error the official SDK raises while it reads a streamed chat."""
    stream = await sdk.chat.completions.create(
        model=model, messages=CHAT["messages"], max_tokens=300, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        async for _chunk in stream:
            started.set()
    except openai.APIError as e:
        return e
    raise AssertionError("the SDK's stream ended without an error")


async def sdk_chat(sdk: openai.AsyncOpenAI, model: str) -> openai.APIStatusError:
    """The error the official SDK raises for a chat that waits for its whole answer."""
    try:
        await sdk.chat.completions.create(
            model=model, messages=CHAT["messages"], max_tokens=300, extra_body={"ignore_eos": True}
        )
    except openai.APIStatusError as e:
        return e
    raise AssertionError("the chat was answered")


def jobs_in(redis: RedisServer) -> int:
    with SyncRedis.from_url(redis.url) as admin:
        return len(admin.keys("ortfleet:job:*"))


def tokens_in(redis: RedisServer, job_id: str) -> int:
    """The token entries of a job's event stream."""
    with SyncRedis.from_url(redis.url) as admin:
        entries = admin.xrange(keys.events(job_id))
    return sum(1 for _, fields in entries if fields.get(b"type") == b"token")


def ended_by_outage(datas: list[str]) -> bool:
    """Whether a chat stream ended with the outage's error chunk and [DONE] (else it ran to its end)."""
    assert datas[-1] == "[DONE]", datas[-3:]
    error = json.loads(datas[-2]).get("error")
    assert error is None or error["code"] == "store_unavailable", error
    return error is not None


async def test_every_reader_of_a_job_whose_redis_stays_away_ends_with_store_unavailable_after_the_limit(
    own_redis: RedisServer, tiny_model: Path, model_name: str
) -> None:
    with Fleet(own_redis.url, tiny_model, env={"ORTFLEET_STORE_OUTAGE_LIMIT_S": str(LIMIT_S)}) as fleet:
        fleet.start_gateway()
        fleet.start_worker(model_name, env=SLOW)
        async with (
            httpx.AsyncClient(base_url=fleet.gateway_url, timeout=60) as client,
            openai.AsyncOpenAI(base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0) as sdk,
        ):
            polled = await submit(client, {"model": model_name, **JOB})
            poll = asyncio.create_task(client.get(f"/v1/jobs/{polled['id']}", params={"wait": 60}))
            streamed = await submit(client, {"model": model_name, **JOB})
            connected, raw_started, sdk_started = asyncio.Event(), asyncio.Event(), asyncio.Event()
            job_stream = asyncio.create_task(read_events(client, streamed["id"], connected=connected))
            raw_chat = asyncio.create_task(
                read_chat_stream(client, {"model": model_name, **CHAT}, raw_started)
            )
            sdk_stream = asyncio.create_task(sdk_chat_stream(sdk, model_name, sdk_started))
            whole_chat = asyncio.create_task(sdk_chat(sdk, model_name))
            for started in (connected, raw_started, sdk_started):
                await asyncio.wait_for(started.wait(), 30)
            await until(lambda: jobs_in(own_redis) == 5, "every job queued", 10)
            # the stream's reader gets tokens before the outage (a busy machine may start it late)
            await until(lambda: tokens_in(own_redis, streamed["id"]) > 0, "the streamed job's tokens", 30)
            # Each reader has tokens (or waits for them): the last ones join as the first tokens come.
            await until(lambda: not poll.done() and not whole_chat.done(), "the waits are open", 1)

            own_redis.process.kill()  # SIGKILL, never restarted
            own_redis.process.wait()
            killed = time.monotonic()

            ended = await asyncio.wait_for(
                asyncio.gather(poll, job_stream, raw_chat, sdk_stream, whole_chat), LIMIT_S + MARGIN_S
            )
            took = time.monotonic() - killed
            polled_reply, events, datas, streamed_error, whole_error = ended

    assert LIMIT_S - 0.5 <= took < LIMIT_S + MARGIN_S, took

    # A long-poll: 503 store_unavailable.
    assert polled_reply.status_code == 503, polled_reply.text
    assert polled_reply.json()["error"]["code"] == "store_unavailable"

    # The job's own stream: an `error` event naming the outage, with the id of the last event before it
    # (a client that resumes from it once Redis is back misses nothing).
    assert isinstance(events[-1], Event) and events[-1].event == "error", events[-3:]
    assert events[-1].data["code"] == "store_unavailable"
    assert "has not answered" in events[-1].data["message"]
    assert any(event.event == "token" for event in events)
    assert events[-1].id == events[-2].id

    # An OpenAI stream: tokens, then an error chunk in OpenAI's shape, then [DONE].
    assert datas[-1] == "[DONE]", datas[-3:]
    error = json.loads(datas[-2])["error"]
    assert error["code"] == "store_unavailable" and error["type"], error
    assert any(json.loads(data).get("choices") for data in datas[:-2])

    # The official SDK raises the in-stream error, and a 503 for the chat that waited.
    assert streamed_error.code == "store_unavailable", streamed_error
    assert isinstance(whole_error, openai.InternalServerError), whole_error
    assert whole_error.status_code == 503 and whole_error.code == "store_unavailable", whole_error


async def test_readers_go_on_without_a_loss_when_redis_is_back_within_the_limit(
    own_redis: RedisServer, tiny_model: Path, model_name: str
) -> None:
    with Fleet(own_redis.url, tiny_model, env={"ORTFLEET_STORE_OUTAGE_LIMIT_S": "15"}) as fleet:
        fleet.start_gateway()
        worker = fleet.start_worker(model_name, env=SLOW)
        async with (
            httpx.AsyncClient(base_url=fleet.gateway_url, timeout=60) as client,
            openai.AsyncOpenAI(base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0) as sdk,
        ):
            streamed = await submit(client, {"model": model_name, **JOB})
            connected, raw_started = asyncio.Event(), asyncio.Event()
            job_stream = asyncio.create_task(read_events(client, streamed["id"], connected=connected))
            raw_chat = asyncio.create_task(
                read_chat_stream(client, {"model": model_name, **CHAT}, raw_started)
            )
            whole_chat = asyncio.create_task(
                sdk.chat.completions.create(
                    model=model_name,
                    messages=CHAT["messages"],
                    max_tokens=40,
                    extra_body={"ignore_eos": True},
                )
            )
            for started in (connected, raw_started):
                await asyncio.wait_for(started.wait(), 30)
            await until(lambda: jobs_in(own_redis) == 3, "every job queued", 10)

            worker.pause()  # nothing is written while Redis is away: what the readers have is all there is
            own_redis.stop()
            own_redis.start()
            worker.resume()

            events, datas, whole = await asyncio.wait_for(
                asyncio.gather(job_stream, raw_chat, whole_chat), 90
            )
            done = await wait_done(client, streamed["id"])

    assert events[-1].event == "done", events[-3:]
    assert streamed_text(events) == done["output"]
    tokens = [event for event in events if event.event == "token"]
    assert sum(len(event.data["token_ids"]) for event in tokens) == 300
    assert datas[-1] == "[DONE]" and not any('"error"' in data for data in datas), datas[-3:]
    text = "".join(
        choice["delta"].get("content") or "" for data in datas[:-1] for choice in json.loads(data)["choices"]
    )
    assert len(text) > 0 and json.loads(datas[-2])["choices"][0]["finish_reason"] == "length"
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None
    assert whole.usage.completion_tokens == 40


async def test_over_two_stores_the_readers_of_the_store_that_stays_away_end_and_the_others_go_on(
    redis_server: RedisServer, own_redis: RedisServer, tiny_model: Path, model_name: str
) -> None:
    stores = {model_name: [redis_server.url, own_redis.url]}
    env = {"ORTFLEET_REDIS_SHARDS": json.dumps(stores), "ORTFLEET_STORE_OUTAGE_LIMIT_S": str(LIMIT_S)}
    with Fleet(redis_server.url, tiny_model, env=env) as fleet:
        fleet.start_gateway()
        for store in ("1", "2"):
            fleet.start_worker(model_name, env={"ORTFLEET_STORE": store, **SLOW})
        fleet.wait_workers(model_name, 2)
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=60) as client:
            ids: list[list[str]] = [[] for _ in range(4)]
            started = [asyncio.Event() for _ in ids]
            body = {"model": model_name, **CHAT, "max_tokens": 200}  # 10 s at 20 tokens/s
            chats = [
                asyncio.create_task(read_chat_stream(client, body, ready, job_id))
                for ready, job_id in zip(started, ids, strict=True)
            ]
            for ready in started:
                await asyncio.wait_for(ready.wait(), 30)
            job_ids = [job_id for (job_id,) in ids]
            with SyncRedis.from_url(own_redis.url) as admin:
                on_second = {job_id for job_id in job_ids if admin.exists(keys.job(job_id))}
            assert 0 < len(on_second) < len(job_ids), "the chats did not spread over both stores"

            own_redis.process.kill()  # store 2, never restarted
            own_redis.process.wait()
            away = [chat for chat, job_id in zip(chats, job_ids, strict=True) if job_id in on_second]
            await asyncio.wait_for(asyncio.gather(*away), LIMIT_S + MARGIN_S)
            ends = await asyncio.wait_for(asyncio.gather(*chats), 10 + MARGIN_S)  # store 1's run to their end

    ended = {job_id for job_id, datas in zip(job_ids, ends, strict=True) if ended_by_outage(datas)}
    assert ended == on_second
