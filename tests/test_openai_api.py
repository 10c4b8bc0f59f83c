"""The OpenAI-compatible API, driven by the official `openai` SDK against a real fleet."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from tests.conftest import Fleet, Proc, keys
from tests.jobs_client import read_events, streamed_text, submit, wait_done

JOB_ID = "x-ortfleet-job-id"
LONG = 480  # generated tokens that take the tiny model long enough to be interrupted (context: 512)


pytestmark = pytest.mark.module_fleet  # one gateway and one served worker for the module's tests


@pytest.fixture
async def async_sdk(fleet: Fleet) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


def chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def counts(usage: openai.types.CompletionUsage | None) -> dict[str, Any]:
    """The usage as the job record holds it: the counts, and the cached prompt tokens where reported."""
    assert usage is not None
    shown: dict[str, Any] = usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    details = usage.prompt_tokens_details
    if details is not None and details.cached_tokens is not None:
        shown["prompt_tokens_details"] = {"cached_tokens": details.cached_tokens}
    return shown


async def test_a_chat_completion_returns_the_jobs_output_and_usage(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    raw = sdk.chat.completions.with_raw_response.create(
        model=served,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"},
        ],
        max_tokens=12,
        temperature=0,
        user="someone",
    )
    completion = raw.parse()
    job = await wait_done(client, raw.headers[JOB_ID])

    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-") and completion.created > 0
    assert completion.model == served
    [choice] = completion.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == job["output"]
    assert choice.finish_reason == "length"
    assert counts(completion.usage) == job["usage"]
    assert job["usage"]["completion_tokens"] == 12


async def test_a_streamed_chat_completion_sends_role_text_finish_usage_and_done(
    async_sdk: openai.AsyncOpenAI, client: httpx.AsyncClient, served: str
) -> None:
    raw = await async_sdk.chat.completions.with_raw_response.create(
        model=served,
        messages=chat("Hello"),
        max_completion_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in raw.parse()]
    job = await wait_done(client, raw.headers[JOB_ID])

    assert all(c.object == "chat.completion.chunk" and c.model == served for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *with_choices, last = chunks
    assert last.choices == [] and counts(last.usage) == job["usage"]
    assert all(c.usage is None for c in with_choices)
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == job["output"]
    assert job["usage"]["completion_tokens"] == 24


async def test_without_include_usage_a_stream_has_no_usage_chunk(
    async_sdk: openai.AsyncOpenAI, served: str
) -> None:
    stream = await async_sdk.chat.completions.create(
        model=served, messages=chat("Hello"), max_tokens=4, temperature=0, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_content_as_a_list_of_text_parts_is_the_same_as_a_string(
    sdk: openai.OpenAI, served: str
) -> None:
    plain = sdk.chat.completions.create(model=served, messages=chat("Hi there"), max_tokens=8, temperature=0)
    parts = sdk.chat.completions.create(
        model=served,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
        max_tokens=8,
        temperature=0,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert counts(parts.usage) == counts(plain.usage)


async def test_a_text_completion_streamed_and_not_gives_the_same_text(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    raw = sdk.completions.with_raw_response.create(
        model=served, prompt="The quick brown fox", max_tokens=20, temperature=0
    )
    completion = raw.parse()
    job = await wait_done(client, raw.headers[JOB_ID])
    chunks = list(
        sdk.completions.create(
            model=served,
            prompt="The quick brown fox",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.choices[0].text == job["output"]
    assert completion.choices[0].finish_reason == "length"
    assert counts(completion.usage) == job["usage"]
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == job["output"]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert counts(chunks[-1].usage) == job["usage"]


async def test_completions_default_to_16_tokens_like_openai(sdk: openai.OpenAI, served: str) -> None:
    completion = sdk.completions.create(model=served, prompt="Hello", temperature=0)  # greedy: no early end
    assert completion.usage is not None and completion.usage.completion_tokens == 16


async def test_a_list_of_prompts_and_n_give_one_choice_per_job(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    raw = sdk.completions.with_raw_response.create(
        model=served, prompt=["Hello", "The quick brown fox"], n=2, max_tokens=6, temperature=0
    )
    completion = raw.parse()
    job_ids = raw.headers[JOB_ID].split(",")
    jobs = [await wait_done(client, job_id) for job_id in job_ids]

    assert len(job_ids) == 4
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.text for c in completion.choices] == [job["output"] for job in jobs]
    assert completion.choices[0].text == completion.choices[1].text  # greedy: n copies of one answer
    assert completion.usage is not None
    prompt_tokens = jobs[0]["usage"]["prompt_tokens"] + jobs[2]["usage"]["prompt_tokens"]
    assert completion.usage.prompt_tokens == prompt_tokens  # each prompt counted once
    assert completion.usage.completion_tokens == 4 * 6


async def test_a_streamed_chat_with_n_choices_interleaves_them_by_index(
    async_sdk: openai.AsyncOpenAI, served: str
) -> None:
    request: dict[str, Any] = {"model": served, "messages": chat("Hello"), "max_tokens": 8, "temperature": 0}
    whole = await async_sdk.chat.completions.create(**request, n=3)
    stream = await async_sdk.chat.completions.create(**request, n=3, stream=True)
    texts, roles, finishes = ["", "", ""], [0, 0, 0], [0, 0, 0]
    async for chunk in stream:
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        finishes[choice.index] += choice.finish_reason == "length"
    assert texts == [choice.message.content for choice in whole.choices]
    assert roles == finishes == [1, 1, 1]


def a_stop_string(text: str) -> str:
    """Three printable characters that first occur a few characters into `text`."""
    for i in range(3, len(text) - 3):
        candidate = text[i : i + 3]
        if candidate.isprintable() and text.find(candidate) == i:
            return candidate
    raise AssertionError(f"no stop string to pick in {text!r}")


async def test_a_stop_string_ends_the_text_before_it_with_finish_reason_stop(
    sdk: openai.OpenAI, served: str
) -> None:
    request: dict[str, Any] = {"model": served, "max_tokens": 60, "temperature": 0}
    messages = chat("Tell me a story")
    free_chat = sdk.chat.completions.create(**request, messages=messages).choices[0].message.content or ""
    free_text = sdk.completions.create(**request, prompt="Once upon a time").choices[0].text
    stop, text_stop = a_stop_string(free_chat), a_stop_string(free_text)

    stopped = sdk.chat.completions.create(**request, messages=messages, stop=stop)
    streamed = list(
        sdk.chat.completions.create(**request, messages=messages, stop=[stop, "never seen"], stream=True)
    )
    completion = sdk.completions.create(**request, prompt="Once upon a time", stop=text_stop)

    expected = free_chat[: free_chat.find(stop)]
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens < 60
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert completion.choices[0].text == free_text[: free_text.find(text_stop)]
    assert completion.choices[0].finish_reason == "stop"


async def test_the_same_seed_reproduces_a_sampled_completion(
    async_sdk: openai.AsyncOpenAI, served: str
) -> None:
    async def sample(seed: int, **extra: Any) -> list[str]:
        completion = await async_sdk.chat.completions.create(
            model=served, messages=chat("Hello"), max_tokens=32, temperature=1.0, seed=seed, **extra
        )
        return [choice.message.content or "" for choice in completion.choices]

    first, again, other = await asyncio.gather(sample(1234), sample(1234), sample(99))
    in_sequence = await sample(1234)
    stream = await async_sdk.chat.completions.create(
        model=served, messages=chat("Hello"), max_tokens=32, temperature=1.0, seed=1234, stream=True
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
    pair = await sample(1234, n=2)
    next_seed = await sample(1235)

    assert first == again == in_sequence
    assert streamed == first[0]
    assert other != first
    assert pair == [first[0], next_seed[0]]  # choice k samples with seed + k
    assert pair[0] != pair[1]


async def test_the_models_list_shows_the_served_model(sdk: openai.OpenAI, served: str) -> None:
    models = sdk.models.list()
    ids = [m.id for m in models.data]
    assert served in ids
    model = next(m for m in models.data if m.id == served)
    assert model.object == "model" and model.owned_by == "ortfleet"
    assert sdk.models.retrieve(served).id == served
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


async def test_unknown_fields_are_ignored(sdk: openai.OpenAI, served: str) -> None:
    completion = sdk.chat.completions.create(
        model=served,
        messages=chat("Hi"),
        max_tokens=2,
        temperature=0,
        extra_body={"not_an_openai_field": {"x": 1}, "store": False, "metadata": {"a": "b"}},
    )
    assert completion.choices[0].finish_reason == "length"


async def test_the_sdks_api_key_is_the_callers_ortfleet_key(fleet: Fleet, model_name: str) -> None:
    key = "ofk_" + secrets.token_urlsafe(24)
    _, url = fleet.start_gateway(env={"ORTFLEET_API_KEYS": f"sdk-{model_name}:{key}"})
    fleet.start_worker(model_name)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model=model_name,
            messages=chat("Hi"),
            max_tokens=2,
            temperature=0,
        )
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="ofk_wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            await stranger.chat.completions.create(
                model=model_name,
                messages=chat("Hi"),
                max_tokens=2,
                temperature=0,
            )
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
        job = await wait_done(http, raw.headers[JOB_ID])  # the caller owns the jobs behind its calls
    assert job["output"] == raw.parse().choices[0].message.content


async def test_an_unknown_model_raises_not_found(sdk: openai.OpenAI, served: str) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.chat.completions.create(model="no-such-model", messages=chat("Hi"))
    assert raised.value.code == "model_not_found"
    assert raised.value.param == "model"


BAD_VALUES: list[tuple[str, Any]] = [
    ("temperature", 5),
    ("top_p", 0),
    ("max_tokens", 0),
    ("max_completion_tokens", -1),
    ("n", 0),
    ("stop", [""]),
    ("max_tokens", 100_000),  # more than the model's context
]
UNSUPPORTED_IN_CHAT: list[tuple[str, Any]] = [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
]
UNSUPPORTED_IN_COMPLETIONS: list[tuple[str, Any]] = [
    ("suffix", " the end"),
    ("best_of", 3),
]


async def test_a_bad_parameter_raises_bad_request_naming_it(sdk: openai.OpenAI, served: str) -> None:
    for param, value in BAD_VALUES:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(model=served, messages=chat("Hi"), extra_body={param: value})
        assert raised.value.param is not None and raised.value.param.startswith(param), param
        assert param in raised.value.message, param


async def test_a_parameter_ortfleet_cannot_honour_is_rejected_by_name(
    sdk: openai.OpenAI, served: str
) -> None:
    for param, value in UNSUPPORTED_IN_CHAT:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(model=served, messages=chat("Hi"), extra_body={param: value})
        assert raised.value.param == param and raised.value.code == "unsupported_parameter", param
        assert param in raised.value.message, param
    for param, value in UNSUPPORTED_IN_COMPLETIONS:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.completions.create(model=served, prompt="Hi", extra_body={param: value})
        assert raised.value.param == param and raised.value.code == "unsupported_parameter", param
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.completions.create(model=served, prompt=[[1, 2, 3]])
    assert raised.value.param == "prompt" and "token-id" in raised.value.message


async def test_neutral_and_null_values_are_accepted(sdk: openai.OpenAI, served: str) -> None:
    completion = sdk.chat.completions.create(
        model=served,
        messages=chat("Hi"),
        max_tokens=2,
        temperature=0,
        logprobs=False,
        presence_penalty=0,
        frequency_penalty=0,
        response_format={"type": "text"},
        tool_choice="none",
        n=1,
        extra_body={"stream": None, "stop": None, "seed": None, "best_of": None},
    )
    assert completion.choices[0].finish_reason == "length"


async def test_non_text_content_is_rejected_by_name(sdk: openai.OpenAI, served: str) -> None:
    image: Any = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(model=served, messages=[{"role": "user", "content": [image]}])
    assert raised.value.param == "messages.0.content.0"
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(
            model=served, messages=[*chat("Hi"), {"role": "tool", "tool_call_id": "x", "content": [image]}]
        )
    assert raised.value.param == "messages.1.content.0"


async def test_a_prompt_longer_than_the_context_raises_bad_request_context_length_exceeded(
    sdk: openai.OpenAI, async_sdk: openai.AsyncOpenAI, client: httpx.AsyncClient, served: str
) -> None:
    long = "The quick brown fox. " * 400
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(
            model=served,
            messages=chat(long),
            max_tokens=4,
            temperature=0,
        )
    assert raised.value.code == "context_length_exceeded" and raised.value.param == "messages"
    assert "context" in raised.value.message
    failed = await wait_done(client, raised.value.response.headers[JOB_ID])
    assert failed["status"] == "failed" and failed["error_code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as streamed:
        await async_sdk.completions.create(
            model=served, prompt=long, max_tokens=4, temperature=0, stream=True
        )
    assert streamed.value.code == "context_length_exceeded" and streamed.value.param == "prompt"


async def test_a_stream_queued_past_the_keep_alive_interval_starts_and_reports_a_late_failure_in_band(
    fleet: Fleet, model_name: str
) -> None:
    worker = fleet.start_worker(model_name)
    _, url = fleet.start_gateway(env={"ORTFLEET_SSE_KEEPALIVE_S": "0.3"})
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    worker.pause()  # the job stays queued past the interval, so the response starts before it runs
    try:
        stream = await sdk.completions.create(
            model=model_name, prompt="The quick brown fox. " * 400, max_tokens=4, temperature=0, stream=True
        )
        worker.resume()
        with pytest.raises(openai.APIError) as raised:
            [chunk async for chunk in stream]
    finally:
        worker.resume()
        await sdk.close()
    assert raised.value.code == "context_length_exceeded"
    assert "context" in raised.value.message


async def test_a_full_queue_raises_rate_limit_and_leaves_no_job_behind(
    fleet: Fleet, model_name: str, redis: Redis
) -> None:
    worker = fleet.start_worker(model_name)
    _, url = fleet.start_gateway(env={"ORTFLEET_MAX_QUEUED_JOBS": "1"})
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    worker.pause()  # jobs stay queued
    try:
        with pytest.raises(openai.RateLimitError) as two:  # the first of the two fits, then is withdrawn
            await sdk.completions.create(
                model=model_name,
                prompt="Hi",
                n=2,
                max_tokens=2,
                temperature=0,
            )
        assert await redis.zcard(keys.queue(model_name)) == 0
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            await submit(http, {"model": model_name, "prompt": "Hi", "max_tokens": 2})
        with pytest.raises(openai.RateLimitError) as full:
            await sdk.chat.completions.create(
                model=model_name,
                messages=chat("Hi"),
                max_tokens=2,
                temperature=0,
            )
    finally:
        worker.resume()
        await sdk.close()
    assert two.value.code == full.value.code == "queue_full"
    assert full.value.response.headers["retry-after"]


async def test_a_job_that_expires_in_the_queue_raises_a_retryable_server_error(
    fleet: Fleet, model_name: str
) -> None:
    worker = fleet.start_worker(model_name)
    _, url = fleet.start_gateway(env={"ORTFLEET_QUEUE_TIMEOUT_S": "0.2"})
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    worker.pause()  # the job waits past its queue deadline, and the gateways' sweep fails it
    try:
        with pytest.raises(openai.InternalServerError) as raised:
            await asyncio.wait_for(sdk.chat.completions.create(model=model_name, messages=chat("Hi")), 10)
    finally:
        worker.resume()
        await sdk.close()
    assert raised.value.status_code == 503 and raised.value.code == "expired_in_queue"


async def pause_when_running(
    worker: Proc, client: httpx.AsyncClient, job_id: str, connected: asyncio.Event
) -> None:
    """Stops the worker process right after the job's first token; `connected` is set once the gateway
    has answered the event stream's request."""
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as events:
        connected.set()
        async for line in events.aiter_lines():
            if line == "event: token":
                worker.pause()
                return


async def far_from_done(redis: Redis, job_id: str) -> bool:
    """Whether the (paused) job still runs with most of its tokens to go: the tiny model is so fast
    that on a loaded machine it can finish before the test stops its worker."""
    if await redis.hget(keys.job(job_id), "status") != "running":  # type: ignore[misc]
        return False
    entries = await redis.xrange(keys.events(job_id))
    published = sum(len(fields["ids"].split(",")) for _, fields in entries if fields.get("ids"))
    return published < LONG // 2


@contextlib.asynccontextmanager
async def listening(redis: Redis, channel: str) -> AsyncIterator[PubSub]:
    """A subscription to one of the fleet's pub/sub channels (submissions wake a model's workers;
    cancels of running jobs go to every worker)."""
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(channel)
    try:
        yield pubsub
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]


async def next_message(pubsub: PubSub, timeout_s: float = 10) -> str:
    async with asyncio.timeout(timeout_s):
        async for message in pubsub.listen():
            return str(message["data"])
    raise AssertionError("the subscription ended")


async def cancel_sent(cancels: PubSub, job_id: str) -> bool:
    """Whether the gateway told the workers to cancel the job (within 10 s)."""
    while await next_message(cancels) != job_id:
        pass
    return True


async def assert_cancelled_and_slot_reused(
    client: httpx.AsyncClient, sdk: openai.AsyncOpenAI, model: str, job_id: str, streamed: str = ""
) -> None:
    done = await wait_done(client, job_id)
    assert done["status"] == "cancelled" and done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] < LONG
    assert done["output"].startswith(streamed)
    assert streamed_text(await read_events(client, job_id)) == done["output"]
    raw = await sdk.completions.with_raw_response.create(
        model=model,
        prompt="Hi",
        max_tokens=4,
        temperature=0,
    )
    after = await wait_done(client, raw.headers[JOB_ID])
    assert after["status"] == "succeeded" and after["worker"] == done["worker"]  # the one slot is free


async def test_a_client_that_leaves_a_stream_cancels_its_generation(
    fleet: Fleet, client: httpx.AsyncClient, async_sdk: openai.AsyncOpenAI, model_name: str, redis: Redis
) -> None:
    worker = fleet.start_worker(model_name, "--max-batch-size", "1")
    async with listening(redis, keys.cancel_channel) as cancels:
        for _attempt in range(5):
            raw = await async_sdk.chat.completions.with_raw_response.create(
                model=model_name, messages=chat("Hello"), max_tokens=LONG, temperature=0, stream=True
            )
            worker.pause()  # the headers come once the job runs: it stays unfinished while paused
            stream, job_id = raw.parse(), raw.headers[JOB_ID]
            if await far_from_done(redis, job_id):
                break
            worker.resume()
            await stream.close()
        else:
            pytest.fail("every job finished before the worker could be paused")
        text = ""
        try:
            async for chunk in stream:
                text += chunk.choices[0].delta.content or ""
                break
            await stream.close()  # the client goes away mid-stream
            assert await cancel_sent(cancels, job_id)
        finally:
            worker.resume()
    await assert_cancelled_and_slot_reused(client, async_sdk, model_name, job_id, text)


async def test_a_client_that_leaves_a_non_streaming_call_cancels_its_generation(
    fleet: Fleet, client: httpx.AsyncClient, async_sdk: openai.AsyncOpenAI, model_name: str, redis: Redis
) -> None:
    worker = fleet.start_worker(model_name, "--max-batch-size", "1")
    try:
        async with (
            listening(redis, keys.wake_channel(model_name)) as submissions,
            listening(redis, keys.cancel_channel) as cancels,
        ):
            for _attempt in range(5):
                worker.pause()  # the job waits in the queue until the test follows its events
                call = asyncio.create_task(
                    async_sdk.completions.create(
                        model=model_name, prompt="Hello", max_tokens=LONG, temperature=0
                    )
                )
                job_id = await next_message(submissions)
                connected = asyncio.Event()
                running = asyncio.create_task(pause_when_running(worker, client, job_id, connected))
                await asyncio.wait_for(connected.wait(), 10)
                worker.resume()
                await running
                if await far_from_done(redis, job_id):
                    break
                worker.resume()
                await call
            else:
                pytest.fail("every job finished before the worker could be paused")
            call.cancel()  # the client goes away while waiting for the whole completion
            with pytest.raises(asyncio.CancelledError):
                await call
            assert await cancel_sent(cancels, job_id)
    finally:
        worker.resume()
    await assert_cancelled_and_slot_reused(client, async_sdk, model_name, job_id)


async def test_a_client_that_leaves_while_its_job_is_queued_withdraws_the_job(
    fleet: Fleet, client: httpx.AsyncClient, async_sdk: openai.AsyncOpenAI, model_name: str, redis: Redis
) -> None:
    worker = fleet.start_worker(model_name)
    worker.pause()
    try:
        async with listening(redis, keys.wake_channel(model_name)) as submissions:
            call = asyncio.create_task(
                async_sdk.chat.completions.create(
                    model=model_name, messages=chat("Hi"), max_tokens=4, temperature=0, stream=True
                )
            )
            job_id = await next_message(submissions)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        job = await wait_done(client, job_id, timeout_s=10)
    finally:
        worker.resume()
    assert job["status"] == "cancelled" and job["attempts"] == 0
