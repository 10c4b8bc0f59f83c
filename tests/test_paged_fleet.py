"""A worker on the paged engine (`--scheduler paged`) in a fleet, on real processes: on the CPU it runs the
tiny model's own graph through block tables, so what it writes is what a worker on the batcher writes:
the same completion and log-probabilities through the OpenAI route, in an engine core as in the worker's
own process, the same echoed prompt log-probabilities, and a cancel. A paged worker's core killed
mid-stream: tests/test_engine_core.py."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import Fleet
from tests.jobs_client import submit, wait_done
from tests.test_engine_core import IN_A_CORE
from tests.test_reliability import SLOW, stream_until_tokens

BODY: dict[str, Any] = {
    "prompt": "The quick brown fox",
    "max_tokens": 40,
    "logprobs": 3,
    "temperature": 0,
    "presence_penalty": 0.4,
}
# A prompt over two of a worker's prefill chunks (128 tokens), echoed with its tokens' log-probabilities.
ECHO: dict[str, Any] = {
    "prompt": "Hello! " * 30,  # 180 tokens of the tiny model
    "max_tokens": 2,
    "echo": True,
    "logprobs": 1,
    "temperature": 0,
}


async def test_a_paged_worker_writes_what_a_batcher_worker_writes_in_a_core_or_in_process(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name + "-batcher", "--scheduler", "batcher")
    fleet.start_worker(model_name + "-paged", "--scheduler", "paged")
    fleet.start_worker(model_name + "-paged-core", "--scheduler", "paged", env=IN_A_CORE)
    answers = []
    for suffix in ("-batcher", "-paged", "-paged-core"):
        response = await client.post("/v1/completions", json={**BODY, "model": model_name + suffix})
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0])
    assert answers[0]["text"] and answers[0]["logprobs"]["top_logprobs"]
    for answer in answers[1:]:
        assert answer["text"] == answers[0]["text"]
        assert answer["logprobs"]["tokens"] == answers[0]["logprobs"]["tokens"]
        for ours, theirs in zip(
            answer["logprobs"]["token_logprobs"], answers[0]["logprobs"]["token_logprobs"], strict=True
        ):
            assert abs(ours - theirs) < 1e-4
    echoed = []
    for suffix in ("-batcher", "-paged"):
        response = await client.post("/v1/completions", json={**ECHO, "model": model_name + suffix})
        assert response.status_code == 200, response.text
        echoed.append(response.json()["choices"][0]["logprobs"])
    assert echoed[1]["tokens"] == echoed[0]["tokens"]
    assert echoed[0]["token_logprobs"][0] is None and echoed[1]["token_logprobs"][0] is None
    for ours, theirs in zip(echoed[1]["token_logprobs"][1:], echoed[0]["token_logprobs"][1:], strict=True):
        assert abs(ours - theirs) < 1e-4


async def test_a_paged_workers_job_is_cancelled_mid_stream(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name, "--scheduler", "paged", env=SLOW)
    job = await submit(client, {"model": model_name, "prompt": "Count with me", "max_tokens": 400})
    await stream_until_tokens(client, job["id"], 5)
    response = await client.delete(f"/v1/jobs/{job['id']}")
    assert response.status_code in (200, 202), response.text
    done = await wait_done(client, job["id"])
    assert done["status"] == "cancelled"
    assert done["usage"]["completion_tokens"] < 400
