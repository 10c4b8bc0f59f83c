"""OpenAI's Responses API (text only), driven by the official `openai` SDK: background responses are jobs
that any gateway retrieves, cancels and streams again after any sequence number."""

from __future__ import annotations

import asyncio
import io
import json
import secrets
import time

import httpx
import openai
import pytest
from redis.asyncio import Redis

from common.events import status_entry
from common.jobs.reads import stage_jobs
from common.jobs.record import JobRecord
from common.stores import Store
from common.wire import JobStatus
from gateway.responses.events import EventFrames
from gateway.streaming.job_events import PushedStream
from gateway.streaming.reading import JobStreamReading
from gateway.streaming.relay import StreamRelay
from tests.conftest import Fleet, RedisServer, keys
from tests.redis_events import add_entry
from tests.stalled_client import TOKENS, StallingBody, stall_mid_stream

# One gateway and one served worker for the module's tests; the keyed one starts a gateway of its own.
pytestmark = pytest.mark.module_fleet


async def until_done(sdk: openai.OpenAI, response_id: str) -> openai.types.responses.Response:
    deadline = time.monotonic() + 60
    while True:
        response = await asyncio.to_thread(sdk.responses.retrieve, response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def test_a_background_response_runs_as_a_job_and_is_retrieved_when_done(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    created = sdk.responses.create(
        model=served,
        input="Say hello",
        instructions="Be brief.",
        max_output_tokens=12,
        temperature=0,  # the tiny model's weights are random: a sampled first token may end the text
        background=True,
    )
    assert created.status == "queued" and created.background
    done = await until_done(sdk, created.id)
    assert done.status in ("completed", "incomplete")
    assert done.output_text and done.usage is not None and done.usage.output_tokens > 0
    jobs = (await client.get("/v1/jobs")).json()["data"]
    assert "job_" + created.id.removeprefix("resp_") in [job["id"] for job in jobs]


async def test_a_streamed_response_resumes_after_a_sequence_number_with_the_same_events(
    sdk: openai.OpenAI, served: str
) -> None:
    stream = sdk.responses.create(
        model=served, input="Count", max_output_tokens=20, temperature=0, stream=True, background=True
    )
    events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    response_id = events[0].response.id
    cut = kinds.index("response.output_text.delta") + 1
    resumed = list(sdk.responses.retrieve(response_id, stream=True, starting_after=cut))
    assert [e.sequence_number for e in resumed] == list(range(cut + 1, len(events)))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in events[cut + 1 :]]
    assert sdk.responses.retrieve(response_id).output_text == text


async def test_cancelling_a_background_response_stops_its_job(sdk: openai.OpenAI, served: str) -> None:
    created = sdk.responses.create(
        model=served, input="Write at length", max_output_tokens=400, temperature=0, background=True
    )
    cancelled = sdk.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert (await until_done(sdk, created.id)).status == "cancelled"


async def test_a_response_asking_for_tools_images_or_files_is_refused_naming_them(
    sdk: openai.OpenAI, served: str
) -> None:
    with pytest.raises(openai.BadRequestError, match="tools"):
        sdk.responses.create(model=served, input="hi", tools=[{"type": "web_search"}])
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]
    with pytest.raises(openai.BadRequestError, match=r"input\.0\.content\.0: images"):
        sdk.responses.create(model=served, input=image)  # type: ignore[arg-type]
    document = [{"role": "user", "content": [{"type": "input_file", "file_id": "file-x"}]}]
    with pytest.raises(openai.BadRequestError, match="files"):
        sdk.responses.create(model=served, input=document)  # type: ignore[arg-type]


async def test_a_foreground_response_answers_with_its_jobs_generated_text(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    response = sdk.responses.create(
        model=served,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        max_output_tokens=8,
        temperature=0,
    )
    assert response.status == "incomplete"  # max_output_tokens reached
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 8
    job = (await client.get("/v1/jobs/job_" + response.id.removeprefix("resp_"))).json()
    assert response.output_text == job["output"]


async def test_a_response_with_store_false_is_answered_and_then_kept_nowhere(
    sdk: openai.OpenAI, client: httpx.AsyncClient, redis: Redis, served: str
) -> None:
    """As OpenAI: an unstored response cannot be retrieved later, through either API."""
    answered = sdk.responses.create(model=served, input="Hi", max_output_tokens=4, temperature=0, store=False)
    assert answered.usage is not None and answered.usage.output_tokens == 4 and answered.store is False
    with sdk.responses.create(
        model=served, input="Hi", max_output_tokens=4, temperature=0, store=False, stream=True
    ) as events:
        streamed = [event for event in events][-1].response
    assert streamed.output_text == answered.output_text
    listed = (await client.get("/v1/jobs", params={"limit": 100})).json()["data"]
    for response in (answered, streamed):
        job_id = "job_" + response.id.removeprefix("resp_")
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(response.id)
        assert (await client.get(f"/v1/jobs/{job_id}")).status_code == 404
        assert job_id not in [job["id"] for job in listed]
        assert not await redis.exists(keys.job(job_id), keys.events(job_id), keys.response(response.id))


@pytest.mark.parametrize("max_output_tokens", [100_000, 10**6])
async def test_a_max_output_tokens_past_the_context_gets_400_naming_max_output_tokens(
    client: httpx.AsyncClient, served: str, max_output_tokens: int
) -> None:
    """100,000 is past the tiny model's context; 10**6 past any job's max_tokens."""
    reply = await client.post(
        "/v1/responses", json={"model": served, "input": "Hi", "max_output_tokens": max_output_tokens}
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "max_output_tokens", error
    assert error["message"].startswith("max_output_tokens: ") and "max_tokens" not in error["message"]


async def test_another_keys_files_batches_and_responses_do_not_exist_for_it(
    redis_server: object, tiny_model: object, model_name: str
) -> None:
    from tests.conftest import ClusterServer, RedisServer

    assert isinstance(redis_server, RedisServer | ClusterServer)
    suffix = secrets.token_hex(4)  # tenants are Redis-wide: each test gets its own
    alice_key, bob_key = "alice-" + "a" * 24, "bob-" + "b" * 24
    env = {"ORTFLEET_API_KEYS": f"alice-{suffix}:{alice_key},bob-{suffix}:{bob_key}"}
    fleet = Fleet(redis_server.url, tiny_model, env=env)  # type: ignore[arg-type]
    try:
        fleet.start_gateway()
        base = fleet.gateway_url + "/v1"
        alice = openai.OpenAI(base_url=base, api_key=alice_key, max_retries=0)
        bob = openai.OpenAI(base_url=base, api_key=bob_key, max_retries=0)
        upload = alice.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert alice.files.retrieve(upload.id).bytes == 3
        with pytest.raises(openai.NotFoundError):
            bob.files.retrieve(upload.id)
        with pytest.raises(openai.NotFoundError):
            bob.files.content(upload.id)
        with pytest.raises(openai.NotFoundError):
            bob.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        batch = alice.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            bob.batches.cancel(batch.id)
        assert batch.id not in [b.id for b in bob.batches.list()]
        assert upload.id not in [f.id for f in bob.files.list()]
        fleet.start_worker(model_name)
        response = alice.responses.create(model=model_name, input="hi", max_output_tokens=4, background=True)
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.cancel(response.id)
    finally:
        fleet.stop_all()


def sse_events(written: list[bytes]) -> list[dict[str, object]]:
    pieces = b"".join(written).split(b"\n\n")
    return [json.loads(p.split(b"\ndata: ", 1)[1]) for p in pieces if p.startswith(b"event: ")]


async def test_a_pushed_response_stream_stops_writing_to_a_stalled_client_then_sends_each_delta_once(
    redis_server: RedisServer, redis: Redis
) -> None:
    """A response's events go out from the relay's callback. Once the client's connection backs up, the
    stream stops taking entries, and when the client reads again it reads on from Redis: every delta
    once, in order, and the sequence numbers unbroken."""
    job_id = "job_pushedresp" + secrets.token_hex(4)
    running = JobRecord(id=job_id, model="m", status=JobStatus.running, created_at=0, attempts=1)
    await stage_jobs(redis, keys, [running])
    stream_key = keys.events(job_id)
    meta = {"id": "resp_" + job_id.removeprefix("job_"), "job_id": job_id, "model": "m", "created_at": "0"}
    relay = StreamRelay(Store(redis_server.url, keys), connections=1, buffer=4)
    await relay.start()
    pauses: list[None] = []
    body = StallingBody()
    try:
        render = EventFrames(meta)
        pushed = PushedStream(
            body, JobStreamReading(relay, redis, job_id, 60), 30, lambda: pauses.append(None), render
        )
        writing = asyncio.create_task(pushed.run(relay, "0-0", render.opening()))

        def deltas() -> list[str]:
            return [e["delta"] for e in sse_events(body.written) if e["type"] == "response.output_text.delta"]

        await add_entry(redis, stream_key, status_entry(JobStatus.running, prompt_tokens=1))
        await stall_mid_stream(redis, relay, stream_key, body, deltas, lambda: len(pauses), writing)
    finally:
        await relay.close()
    events = sse_events(body.written)
    assert deltas() == TOKENS
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "".join(deltas())  # type: ignore[index]
