"""One tenant's grammar cannot take a worker from the others: the gateway refuses a grammar too complex for
the engine, naming the limit; a grammar that still breaks the engine fails its own job, and its worker
hands back the jobs it held, leaves the ready workers, and serves again on a new engine."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from redis.asyncio import Redis

from common.guidance import ResponseFormat
from common.redis_client import connect
from common.registry import heartbeat, live_workers
from gateway.guidance_check import PROBE_BYTES, check
from tests.conftest import Fleet, keys
from tests.fake_workers import Started, worker_info
from tests.jobs_client import submit, wait_done
from tests.redis_events import wait_final, wait_for_tokens
from tests.test_observability import value
from tests.test_structured_output import PERSON
from tests.test_worker_fake_engine import submit as submit_to_redis
from worker.engines.fake_engine import FakeEngine
from worker.service import EngineUnrecoverable

# Each breaks og.Engine's llguidance (with its default limits) at the first token it generates.
TOO_COMPLEX = [
    ({"type": "regex", "regex": "((a{1000}){1000}){1000}"}, "step_lexer_fuel"),
    ({"type": "grammar", "grammar": 'start: "a"{1000000}'}, "step_max_items"),
]
# Free text longer than the gateway's probe walks, then a million forced bytes: it passes the gateway's
# checks and breaks the engine when a job gets that far.
ENGINE_BREAKER = f'start: /[a-z]{{{PROBE_BYTES + 44}}}/ "a"{{1000000}}'


def chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


@pytest.mark.unit
def test_the_gateways_check_passes_ordinary_structured_output_and_refuses_what_exceeds_the_limits() -> None:
    ordinary = [
        ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"schema": PERSON}}),
        ResponseFormat(type="json_object"),
        ResponseFormat(type="regex", regex=r"[A-Z]{3}-\d{2}"),
        ResponseFormat(type="choice", choice=["red", "green!"]),
        ResponseFormat(type="grammar", grammar='start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'),
        ResponseFormat(type="grammar", grammar=ENGINE_BREAKER),  # its trap lies past what the probe walks
    ]
    for form in ordinary:
        guidance = form.guidance()
        assert guidance is not None and check(guidance) is None, form
    for raw, limit in TOO_COMPLEX:
        guidance = ResponseFormat.model_validate(raw).guidance()
        assert guidance is not None
        problem = check(guidance)
        assert problem is not None and problem.limit == limit and limit in problem.message


@pytest.mark.parametrize(("response_format", "limit"), TOO_COMPLEX)
async def test_a_grammar_too_complex_for_the_engine_is_refused_with_a_400_naming_the_limit(
    client: httpx.AsyncClient, served: str, response_format: dict[str, str], limit: str
) -> None:
    job = {"model": served, "prompt": "Hi", "max_tokens": 5, "response_format": response_format}
    completion = {
        "model": served,
        "messages": chat("Hi"),
        "max_tokens": 5,
        "response_format": response_format,
    }
    for path, body in (("/v1/jobs", job), ("/v1/chat/completions", completion)):
        reply = await client.post(path, json=body)

        assert reply.status_code == 400, (path, reply.text)
        error = reply.json()["error"]
        assert error["code"] == "invalid_response_format" and error["param"] == "response_format", path
        assert limit in error["message"] and "too complex for the engine" in error["message"], error


class RegistryStates:
    """The states one worker writes to its registry entry, in order, as Redis receives them (MONITOR):
    a state held for a moment only is seen all the same."""

    def __init__(self, worker_id: str) -> None:
        self.key = keys.worker(worker_id)
        self.seen: list[str] = []

    async def watch(self, redis: Redis, started: asyncio.Event) -> None:
        async with redis.monitor() as monitor:
            started.set()
            async for command in monitor.listen():
                text = command["command"]
                if text.startswith(f"HSET {self.key} ") and (state := re.search(r" state (\w+)", text)):
                    self.seen.append(state.group(1))


@contextlib.asynccontextmanager
async def registry_states(redis_url: str, worker_id: str) -> AsyncIterator[RegistryStates]:
    states = RegistryStates(worker_id)
    redis = connect(redis_url)
    started = asyncio.Event()
    watching = asyncio.create_task(states.watch(redis, started))
    await started.wait()
    try:
        yield states
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        await redis.aclose()


async def test_a_grammar_that_breaks_og_engine_fails_its_job_alone_and_the_worker_serves_on_a_new_engine(
    fleet: Fleet, client: httpx.AsyncClient, sdk: openai.OpenAI, redis: Redis, model_name: str
) -> None:
    worker = fleet.start_worker(model_name, "--scheduler", "og-engine")
    [entry] = [w for w in await live_workers(redis, keys) if w["model"] == model_name]
    ordinary = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 460, "min_tokens": 460}
    breaker = {
        "model": model_name,
        "prompt": "Letters:",
        "max_tokens": 460,
        "response_format": {"type": "grammar", "grammar": ENGINE_BREAKER},
    }
    async with registry_states(fleet.redis_url, entry["id"]) as states:
        worker.pause()  # the four jobs wait, so that one static batch takes them together
        try:
            others = [(await submit(client, ordinary))["id"] for _ in range(3)]
            broken = (await submit(client, breaker))["id"]
        finally:
            worker.resume()

        failed = await wait_done(client, broken)
        finished = [await wait_done(client, job_id) for job_id in others]
        answers = [
            sdk.chat.completions.create(
                model=model_name,
                messages=chat("Once upon a time"),
                max_tokens=8,
                temperature=0,
                extra_body={"min_tokens": 8},
            )
            for _ in range(10)
        ]

    assert failed["status"] == "failed" and failed["error_code"] == "invalid_response_format", failed
    assert "response_format" in failed["error"] and "Too many items" in failed["error"], failed["error"]
    assert failed["attempts"] == 1  # not retried: not on this worker, not on another
    for job in finished:  # handed back when the engine failed, resumed on the new one, not charged
        assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 460, job
        assert job["attempts"] == 2 and job["worker_deaths"] == 0 and job["quarantine_deaths"] == 0, job
    texts = {answer.choices[0].message.content for answer in answers}
    assert len(texts) == 1 and texts.pop(), answers  # all ten answered, with the same text (greedy)
    # Out of the ready workers while the engine was rebuilt (/readyz counts only those: see below).
    assert "recovering" in states.seen and states.seen[-1] == "ready", states.seen
    assert states.seen.index("recovering") < len(states.seen) - 1
    assert worker.process.poll() is None  # the same process serves on
    [after] = [w for w in await live_workers(redis, keys) if w["model"] == model_name]
    assert after["id"] == entry["id"] and after["state"] == "ready"
    metrics = (await client.get(after["metrics_url"])).text
    assert value(metrics, "ortfleet_engine_restarts_total", model=model_name) == 1


async def test_on_the_batcher_a_grammar_that_breaks_fails_its_job_alone_and_the_others_go_on_unharmed(
    fleet: Fleet, client: httpx.AsyncClient, redis: Redis, model_name: str
) -> None:
    worker = fleet.start_worker(model_name, "--scheduler", "batcher")
    [entry] = [w for w in await live_workers(redis, keys) if w["model"] == model_name]
    ordinary = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 460, "min_tokens": 460}
    breaker = {
        "model": model_name,
        "prompt": "Letters:",
        "max_tokens": 460,
        "response_format": {"type": "grammar", "grammar": ENGINE_BREAKER},
    }
    worker.pause()  # the four jobs run side by side
    try:
        others = [(await submit(client, ordinary))["id"] for _ in range(3)]
        broken = (await submit(client, breaker))["id"]
    finally:
        worker.resume()
    failed = await wait_done(client, broken)
    finished = [await wait_done(client, job_id) for job_id in others]

    assert failed["status"] == "failed" and failed["error_code"] == "invalid_response_format", failed
    assert "response_format" in failed["error"] and "Too many items" in failed["error"], failed["error"]
    assert "<state>" not in failed["error"] and failed["attempts"] == 1
    for job in finished:  # the grammar's row ended alone: the others ran on, never handed back
        assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 460, job
        assert job["attempts"] == 1, job
    metrics = (await client.get(entry["metrics_url"])).text
    assert value(metrics, "ortfleet_engine_restarts_total", model=model_name) == 0
    assert worker.process.poll() is None


async def test_readyz_does_not_count_a_worker_whose_engine_is_being_rebuilt(
    own_fleet: Fleet, own_redis_client: Redis, model_name: str
) -> None:
    info = worker_info(model_name, FakeEngine(0.01, 1))
    async with httpx.AsyncClient(base_url=own_fleet.gateway_url, timeout=10) as http:
        info.state = "recovering"
        await heartbeat(own_redis_client, keys, info, 30, 60)
        rebuilding = await http.get("/readyz")
        info.state = "ready"
        await heartbeat(own_redis_client, keys, info, 30, 60)
        ready = await http.get("/readyz")

    assert rebuilding.status_code == 503 and "rebuilding a failed engine" in rebuilding.json()["reason"]
    assert ready.status_code == 200 and ready.json()["models"] == {model_name: {"workers": 1}}


# The same on the fake engine, in-process: the worker's part, and a worker that cannot recover.


async def test_a_worker_whose_engine_fails_hands_back_the_other_jobs_and_takes_work_again_once_rebuilt(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    engine = FakeEngine(0.01, 3)
    service = start_worker(model_name, engine)
    jobs = [await submit_to_redis(redis, model_name, f"job {i}", max_tokens=60) for i in range(3)]
    for job_id in jobs:
        await wait_for_tokens(redis, job_id, 2)

    engine.fail("the engine broke")
    records = [await wait_final(redis, job_id) for job_id in jobs]
    later = await wait_final(redis, await submit_to_redis(redis, model_name, "later", max_tokens=5))

    [broken] = [record for record in records if record["status"] == "failed"]
    assert broken["error_code"] == "job_failed" and broken["error"] == "the engine broke"
    assert broken["attempts"] == "1"
    others = [record for record in records if record is not broken]
    for record in others:
        assert record["status"] == "succeeded" and record["attempts"] == "2", record
        assert record["worker_deaths"] == "0" and record.get("preemptions", "0") == "0"
    assert later["status"] == "succeeded" and service.engine_restarts == 1
    assert service.info.state == "ready"


async def test_a_worker_whose_engine_cannot_be_made_again_hands_back_its_jobs_and_stops_with_an_error(
    redis: Redis, start_worker: Started, model_name: str
) -> None:
    engine = FakeEngine(0.01, 2)
    engine.restart_error = RuntimeError("out of device memory")
    service = start_worker(model_name, engine)
    jobs = [await submit_to_redis(redis, model_name, f"job {i}", max_tokens=60) for i in range(2)]
    for job_id in jobs:
        await wait_for_tokens(redis, job_id, 2)

    engine.fail("the engine broke")
    with pytest.raises(EngineUnrecoverable, match="out of device memory"):
        await asyncio.wait_for(start_worker.run_of(service), 10)

    assert [w for w in await live_workers(redis, keys) if w["id"] == service.info.id] == []
    statuses = [(await redis.hgetall(keys.job(job_id)))["status"] for job_id in jobs]  # type: ignore[misc]
    assert sorted(statuses) == ["failed", "running"]
    [handed_back] = [job_id for job_id, status in zip(jobs, statuses, strict=True) if status == "running"]
    assert await redis.zscore(keys.queue(model_name, "interactive"), handed_back) is not None  # its place
    assert service.engine_restarts == 0
