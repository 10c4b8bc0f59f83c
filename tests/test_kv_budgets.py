"""Workers of one model with different KV budgets (ORTFLEET_KV_BUDGET_TOKENS): each claims only the jobs it
can hold, and a job that none of the live workers could hold is refused when it is submitted."""

from __future__ import annotations

import asyncio

import httpx

from tests.conftest import Fleet
from tests.jobs_client import submit, wait_done

# The tiny model's context is 512 tokens: budgets below it bound what one job may reserve.
SMALL_BUDGET, LARGE_BUDGET = 128, 256


def worker_pid(job: dict[str, object]) -> int:
    """The process id in a job's worker id (host-pid-suffix)."""
    return int(str(job["worker"]).split("-")[-2])


async def test_a_job_larger_than_a_workers_kv_budget_is_left_to_a_worker_with_a_larger_one(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name, env={"ORTFLEET_KV_BUDGET_TOKENS": str(SMALL_BUDGET)})
    large = fleet.start_worker(model_name, env={"ORTFLEET_KV_BUDGET_TOKENS": str(LARGE_BUDGET)})
    big = {"model": model_name, "prompt": "Hello", "max_tokens": 200}  # needs 201 or more
    little = {"model": model_name, "prompt": "Hello", "max_tokens": 8}

    jobs = [await submit(client, big if i % 2 else little) for i in range(12)]
    done = await asyncio.gather(*(wait_done(client, job["id"]) for job in jobs))

    assert [job["status"] for job in done] == ["succeeded"] * 12, [job.get("error") for job in done]
    assert {worker_pid(job) for job in done[1::2]} == {large.pid}


async def test_a_job_no_live_worker_has_the_kv_budget_for_is_refused_naming_the_limit(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name, env={"ORTFLEET_KV_BUDGET_TOKENS": str(SMALL_BUDGET)})
    fleet.start_worker(model_name, env={"ORTFLEET_KV_BUDGET_TOKENS": str(LARGE_BUDGET)})

    reply = await client.post("/v1/jobs", json={"model": model_name, "prompt": "Hi", "max_tokens": 300})
    chat = await client.post(
        "/v1/chat/completions",
        json={"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 300},
    )

    assert reply.status_code == 422, reply.text
    assert chat.status_code == 400, chat.text  # OpenAI's status for a request it cannot serve
    for answer in (reply, chat):
        error = answer.json()["error"]
        assert error["param"] == "max_tokens"
        assert str(LARGE_BUDGET) in error["message"] and "ORTFLEET_KV_BUDGET_TOKENS" in error["message"]
    fits = await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 200})
    assert (await wait_done(client, fits["id"]))["status"] == "succeeded"
