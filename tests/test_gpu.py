"""What users rely on, on the GPU path: a worker running the default model built fp16 with paged
attention on CUDA (og.Engine's dynamic batching), behind a real gateway, driven by the openai SDK and the
job API. Skipped where onnxruntime-genai cannot use CUDA; `scripts/gpu-report` runs them on a GPU host."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from ortfleet.bench.machine import child_pids
from ortfleet.fleet.processes import free_port
from tests.conftest import Fleet, RedisServer
from tests.gpu_marks import ON_A_GPU
from tests.jobs_client import read_events, streamed_text, submit, wait_done
from tests.test_reliability import assert_contiguous, kill_while_streaming, stream_until_tokens

pytestmark = ON_A_GPU

NAME = "smollm2-gpu"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cuda_model() -> Path:
    """The default model built fp16 with paged attention for CUDA, in the model cache."""
    from common.settings import FleetSettings
    from ortfleet.modelbuild.default import ensure_default_model

    return ensure_default_model(FleetSettings().model_cache, device="cuda")


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def gpu_fleet(redis_server: RedisServer, cuda_model: Path) -> Iterator[Fleet]:
    """A gateway and one worker on cuda:0 serving the CUDA model as NAME (its /metrics on
    METRICS_PORT), for the module."""
    fleet = Fleet(redis_server.url, cuda_model)
    try:
        fleet.start_gateway()
        # half the card: the tests below start more workers on it, each with a share of its own
        share = {"ORTFLEET_GPU_KV_FRACTION": "0.5"}
        fleet.start_worker(
            NAME, "--metrics-port", str(METRICS_PORT), device="cuda:0", env=share, timeout_s=180
        )
        yield fleet
    finally:
        fleet.stop_all()


@pytest.fixture
async def gpu_client(gpu_fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gpu_fleet.gateway_url, timeout=60) as http:
        yield http


@pytest.fixture
def gpu_sdk(gpu_fleet: Fleet) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gpu_fleet.gateway_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


async def test_the_gpu_worker_runs_og_engine_continuously_on_cuda_with_rows_sized_from_the_card(
    gpu_client: httpx.AsyncClient,
) -> None:
    fleet = (await gpu_client.get("/v1/fleet")).json()
    worker = next(w for w in fleet["workers"] if w["model"] == NAME)
    assert worker["device"] == "cuda:0" and worker["gpu"] == "0"
    assert worker["engine_mode"] == "continuous"
    assert worker["capacity"] > 1  # sized from the card's KV memory and the timed decode steps


def test_a_chat_on_the_gpu_answers_the_capital_of_france(gpu_sdk: openai.OpenAI) -> None:
    reply = gpu_sdk.chat.completions.create(model=NAME, messages=CAPITAL, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


def test_a_streamed_chat_on_the_gpu_ends_with_a_finish_reason_and_usage(gpu_sdk: openai.OpenAI) -> None:
    chunks = list(
        gpu_sdk.chat.completions.create(
            model=NAME,
            messages=CAPITAL,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert "Paris" in text and finishes in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_stop_strings_end_a_gpu_completion_before_the_stop_text(gpu_sdk: openai.OpenAI) -> None:
    reply = gpu_sdk.chat.completions.create(
        model=NAME,
        messages=CAPITAL,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        stop=["Paris"],
    )
    assert reply.choices[0].finish_reason == "stop"
    assert "Paris" not in (reply.choices[0].message.content or "")


class City(BaseModel):
    name: str
    country: str


def test_structured_output_on_the_gpu_parses_into_the_schema(gpu_sdk: openai.OpenAI) -> None:
    reply = gpu_sdk.chat.completions.parse(
        model=NAME,
        messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
        response_format=City,
        max_tokens=60,
        temperature=0,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


def test_a_required_tool_call_on_the_gpu_has_arguments_that_parse(gpu_sdk: openai.OpenAI) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    reply = gpu_sdk.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    calls = reply.choices[0].message.tool_calls or []
    assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)  # type: ignore[union-attr]


def test_a_seed_on_the_gpu_gives_the_same_sampled_text_again(gpu_sdk: openai.OpenAI) -> None:
    def sampled(seed: int) -> str:
        reply = gpu_sdk.completions.create(
            model=NAME, prompt="Once upon a time", max_tokens=32, temperature=1.0, seed=seed
        )
        return reply.choices[0].text

    assert sampled(7) == sampled(7)


def test_n_choices_on_the_gpu_each_answer(gpu_sdk: openai.OpenAI) -> None:
    reply = gpu_sdk.chat.completions.create(
        model=NAME,
        messages=CAPITAL,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0.8,
        n=4,
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert all(c.message.content for c in reply.choices)


def test_logprobs_on_the_gpu_are_refused_by_name_where_og_engine_exposes_no_logits(
    gpu_sdk: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        gpu_sdk.chat.completions.create(
            model=NAME,
            messages=CAPITAL,  # type: ignore[arg-type]
            max_tokens=8,
            logprobs=True,
        )
    assert "logprobs" in str(refused.value)


async def test_a_running_gpu_job_is_cancelled_within_a_step(gpu_client: httpx.AsyncClient) -> None:
    job = await submit(
        gpu_client, {"model": NAME, "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True}
    )
    await stream_until_tokens(gpu_client, job["id"], 8)
    asked = time.monotonic()
    assert (await gpu_client.delete(f"/v1/jobs/{job['id']}")).status_code in (200, 202)
    done = await wait_done(gpu_client, job["id"], timeout_s=10)
    assert done["status"] == "cancelled" and time.monotonic() - asked < 5
    assert done["usage"]["completion_tokens"] < 4000


async def test_the_gpu_workers_metrics_carry_its_gpu_label(gpu_client: httpx.AsyncClient) -> None:
    job = await submit(gpu_client, {"model": NAME, "prompt": "Hi", "max_tokens": 4})
    await wait_done(gpu_client, job["id"])
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"http://127.0.0.1:{METRICS_PORT}/metrics")).text
    generated = [line for line in text.splitlines() if not line.startswith("#") and 'gpu="0"' in line]
    assert generated and all('device="cuda:0"' in line or "device=" not in line for line in generated)


async def test_a_gpu_job_whose_worker_is_killed_resumes_on_another_gpu_worker_without_gap_or_duplicate(
    gpu_fleet: Fleet, gpu_client: httpx.AsyncClient
) -> None:
    name = NAME + "-resume"
    env = {
        "ORTFLEET_HEARTBEAT_TTL_S": "2",
        "ORTFLEET_STEP_DELAY_S": "0.01",
        "ORTFLEET_GPU_KV_FRACTION": "0.05",
    }
    first = gpu_fleet.start_worker(name, device="cuda:0", env=env, timeout_s=180)
    second = gpu_fleet.start_worker(name, device="cuda:0", env=env, timeout_s=180)
    body = {"model": name, "prompt": "The history of the harbour town", "max_tokens": 300, "ignore_eos": True}
    job = await kill_while_streaming(gpu_client, body, first, second, 40)
    events = await read_events(gpu_client, job["id"])
    done = await wait_done(gpu_client, job["id"])
    assert done["status"] == "succeeded" and done["attempts"] == 2
    ids = assert_contiguous(events)
    assert len(ids) == done["usage"]["completion_tokens"] == 300
    assert streamed_text(events) == done["output"]


async def sixteen_stories(gpu_client: httpx.AsyncClient, name: str) -> list[dict[str, Any]]:
    """16 jobs of 64 tokens submitted at once, each done; their records."""
    jobs = [
        await submit(
            gpu_client, {"model": name, "prompt": f"Story {i}:", "max_tokens": 64, "ignore_eos": True}
        )
        for i in range(16)
    ]
    done = await asyncio.gather(*(wait_done(gpu_client, job["id"]) for job in jobs))
    assert all(d["status"] == "succeeded" for d in done)
    return list(done)


async def test_two_workers_sharing_one_gpu_split_the_jobs_between_them(
    gpu_fleet: Fleet, gpu_client: httpx.AsyncClient
) -> None:
    name = NAME + "-shared"
    env = {"ORTFLEET_GPU_KV_FRACTION": "0.05", "ORTFLEET_MAX_BATCH_SIZE": "4"}
    workers = [gpu_fleet.start_worker(name, device="cuda:0", env=env, timeout_s=180) for _ in range(2)]
    done = await sixteen_stories(gpu_client, name)
    by_worker: dict[str, int] = {}
    for d in done:
        by_worker[d["worker"]] = by_worker.get(d["worker"], 0) + 1
    assert len(by_worker) == 2, by_worker  # rows of 4 each: 16 jobs at once need both
    assert all(worker.pid for worker in workers)


async def test_a_gpu_workers_engine_core_killed_mid_stream_is_replaced_and_its_job_resumes(
    gpu_fleet: Fleet, gpu_client: httpx.AsyncClient
) -> None:
    name = NAME + "-core"
    env = {"ORTFLEET_STEP_DELAY_S": "0.01", "ORTFLEET_GPU_KV_FRACTION": "0.05"}
    worker = gpu_fleet.start_worker(name, device="cuda:0", env=env, timeout_s=180)
    (core,) = child_pids(worker.pid)  # a GPU worker's engine runs in a core of its own by default
    body = {"model": name, "prompt": "The history of the harbour town", "max_tokens": 300, "ignore_eos": True}
    job = await submit(gpu_client, body)
    await stream_until_tokens(gpu_client, job["id"], 40)
    os.kill(core, signal.SIGKILL)
    events = await read_events(gpu_client, job["id"])
    done = await wait_done(gpu_client, job["id"], timeout_s=180)  # the new core loads the model again
    assert done["status"] == "succeeded" and done["attempts"] == 2
    assert len(assert_contiguous(events)) == done["usage"]["completion_tokens"] == 300
    assert worker.alive() and child_pids(worker.pid) not in ([], [core])


async def test_two_gpu_workers_on_one_shared_engine_core_split_its_rows(
    gpu_fleet: Fleet, gpu_client: httpx.AsyncClient, tmp_path: Path
) -> None:
    name = NAME + "-shared-core"
    path = tmp_path / "gpu0.sock"
    core = gpu_fleet.start_core(
        path, 2, "--max-batch-size", "8", device="cuda:0", env={"ORTFLEET_GPU_KV_FRACTION": "0.05"}
    )
    attach = {"ORTFLEET_ENGINE_CORE": f"unix:{path}"}
    workers = [gpu_fleet.start_worker(name, device="cuda:0", env=attach, timeout_s=180) for _ in range(2)]
    done = await sixteen_stories(gpu_client, name)
    assert len({d["worker"] for d in done}) == 2  # 4 rows each: 16 jobs at once need both
    assert core.alive() and all(worker.alive() for worker in workers)
