"""A job that fails is an error on every route, never a success: the job API shows it failed with its code,
an OpenAI call answers an HTTP error or ends its stream with one (which the SDK raises), a Responses call
fails; and a seed anywhere in OpenAI's range samples rather than failing its job in the engine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx
import openai
import pytest

from common.events import done_entry
from common.wire import JobStatus
from gateway.openai_api.choices import ChoiceEvent
from gateway.responses.events import EventFrames
from tests.conftest import Fleet
from tests.jobs_client import read_events, submit, wait_done

JOB_ID = "x-ortfleet-job-id"
# A job whose prompt holds this fails on its worker with job_failed (ORTFLEET_FAIL_MARKER, a testing aid).
FAILS = "fail-this-job"
TOO_LONG = "The quick brown fox. " * 400  # far past the tiny model's context of 512 tokens


pytestmark = pytest.mark.module_fleet  # one gateway and one served worker for the module's tests


@pytest.fixture(scope="module")
def failing(module_gateway: Fleet) -> str:
    """A model name served, for the whole module, by a worker that fails every job whose prompt holds
    FAILS."""
    module_gateway.start_worker("tiny-fails-marked-jobs", env={"ORTFLEET_FAIL_MARKER": FAILS})
    return "tiny-fails-marked-jobs"


def call(
    sdk: openai.OpenAI, route: str, model: str, *, stream: bool, prompt: str = "Hello", **extra: Any
) -> Any:
    """A chat or text completion of a few sampled tokens; `extra` goes in the body as it is."""
    if route == "chat":
        return sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=4,
            temperature=1.0,
            stream=stream,
            extra_body=extra,
        )
    return sdk.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=1.0, stream=stream, extra_body=extra
    )


def finish_reasons(chunks: Iterable[Any]) -> list[str]:
    return [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]


async def test_a_job_that_fails_on_its_worker_reads_failed_with_job_failed_and_its_events_end_in_an_error(
    client: httpx.AsyncClient, failing: str
) -> None:
    job = await submit(client, {"model": failing, "prompt": FAILS, "max_tokens": 4, "temperature": 1.0})
    done = await wait_done(client, job["id"])
    events = await read_events(client, job["id"])

    assert done["status"] == "failed" and done["finish_reason"] == "error"
    assert done["error_code"] == "job_failed" and "fail marker" in done["error"]
    assert events[-1].event == "error"
    assert events[-1].data["code"] == "job_failed" and events[-1].data["status"] == "failed"
    assert "done" not in [event.event for event in events]


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_a_completion_whose_job_fails_on_its_worker_raises_a_500_job_failed_server_error(
    sdk: openai.OpenAI, client: httpx.AsyncClient, failing: str, route: str
) -> None:
    with pytest.raises(openai.InternalServerError) as raised:
        call(sdk, route, failing, stream=False, prompt=FAILS)

    error = raised.value
    assert error.status_code == 500 and error.code == "job_failed" and error.type == "server_error"
    assert "fail marker" in error.message
    assert isinstance(error.body, dict) and set(error.body) == {"message", "type", "param", "code"}
    job = await wait_done(client, error.response.headers[JOB_ID])
    assert job["status"] == "failed" and job["error_code"] == "job_failed"


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_a_completion_stream_whose_job_fails_on_its_worker_ends_in_an_error_the_sdk_raises(
    sdk: openai.OpenAI, failing: str, route: str
) -> None:
    chunks: list[Any] = []
    with pytest.raises(openai.APIError) as raised:
        chunks.extend(call(sdk, route, failing, stream=True, prompt=FAILS))

    assert raised.value.code == "job_failed" and "fail marker" in raised.value.message
    assert finish_reasons(chunks) == []  # no choice finished as if it had succeeded


async def test_a_response_whose_job_fails_is_an_http_error_in_the_foreground_and_ends_failed_streamed(
    sdk: openai.OpenAI, served: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.responses.create(model=served, input=TOO_LONG, max_output_tokens=4, temperature=0)
    events = list(
        sdk.responses.create(model=served, input=TOO_LONG, max_output_tokens=4, temperature=0, stream=True)
    )

    assert raised.value.code == "context_length_exceeded" and raised.value.param == "input"
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    error = last.response.model_dump()["error"]  # OpenAI's Responses codes have no context_length_exceeded
    assert error["code"] == "invalid_prompt" and error["message"].startswith("context_length_exceeded: ")
    assert not {"response.completed", "response.incomplete"} & {event.type for event in events}


@pytest.mark.unit
def test_a_done_event_whose_status_is_failed_reads_as_a_failure_too() -> None:
    final = {**done_entry(JobStatus.failed, "error", None), "message": "engine error FAILED"}
    meta = {"id": "resp_x", "job_id": "job_x", "model": "tiny", "created_at": "0"}

    streamed = EventFrames(meta)([("1-0", final)]).decode()

    assert ChoiceEvent(0, final).failed
    assert "event: response.failed" in streamed and "response.incomplete" not in streamed
    assert not ChoiceEvent(0, done_entry(JobStatus.succeeded, "stop", None)).failed


async def test_any_64_bit_seed_samples_and_seeds_2_to_the_31_apart_sample_alike(
    sdk: openai.OpenAI, served: str
) -> None:
    def sample(seed: int) -> tuple[str, int]:
        completion = sdk.completions.create(
            model=served,
            prompt="Hello",
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        assert completion.usage is not None
        return completion.choices[0].text, completion.usage.completion_tokens

    five = sample(5)
    assert five[1] == 8
    assert sample(5 + 2**31) == sample(5 - 2**31) == five
    assert sample(-1) == sample(2**63 - 1) == sample(2**31 - 1)
    assert sample(-(2**63)) == sample(0)


async def test_a_seed_beyond_64_bits_is_refused_naming_it(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as raised:
            call(sdk, "chat", served, stream=False, seed=seed)
        assert raised.value.param == "seed"
    reply = await client.post("/v1/jobs", json={"model": served, "prompt": "Hello", "seed": 2**63})
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "seed"


async def test_a_job_seed_past_31_bits_samples_like_the_seed_modulo_2_to_the_31(
    client: httpx.AsyncClient, served: str
) -> None:
    body = {"model": served, "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    low = await wait_done(client, (await submit(client, {**body, "seed": 7}))["id"])
    high = await wait_done(client, (await submit(client, {**body, "seed": 7 + 2**32}))["id"])
    top = await wait_done(client, (await submit(client, {**body, "seed": 2**63 - 1}))["id"])

    assert high["status"] == top["status"] == "succeeded", (high, top)
    assert high["output"] == low["output"] and high["usage"]["completion_tokens"] == 8


async def test_a_temperature_too_small_to_sample_with_is_greedy_not_a_failed_job(
    sdk: openai.OpenAI, served: str
) -> None:
    def complete(**sampling: Any) -> tuple[str, str | None]:
        reply = sdk.completions.create(model=served, prompt="Hello", max_tokens=8, extra_body=sampling)
        return reply.choices[0].text, reply.choices[0].finish_reason

    # float32 holds 2.2e-309 as 0, a temperature beside which the engine refuses sampling options (top_k)
    assert complete(temperature=2.2e-309, top_k=55) == complete(temperature=0)


async def test_a_top_k_past_the_vocabulary_samples_as_no_bound_at_all(
    sdk: openai.OpenAI, served: str
) -> None:
    def sample(top_k: int) -> str:
        completion = sdk.completions.create(
            model=served, prompt="Hello", max_tokens=8, temperature=1.0, seed=3, extra_body={"top_k": top_k}
        )
        return completion.choices[0].text

    assert sample(1000) == sample(0)  # the tiny model has 320 tokens; 1000 bounds nothing
