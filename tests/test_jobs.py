"""The async job API against a real fleet: redis-server, worker processes on a tiny model, a gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from httpx_sse import aconnect_sse
from redis.asyncio import Redis

from common.keys import STANDALONE
from ortfleet.fleet.processes import free_port, start_redis, stop
from tests.conftest import LOGS, Fleet, RedisServer
from tests.jobs_client import read_events, streamed_text, submit, wait_done
from tests.waiting import until_seen

pytestmark = pytest.mark.module_fleet  # one gateway for the module's tests; each starts its own workers


async def test_a_submitted_job_succeeds_with_output_usage_and_timings(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    worker = fleet.start_worker(model_name)
    job = await submit(client, {"model": model_name, "prompt": "Hello world", "max_tokens": 16})
    assert job["status"] in ("queued", "running")  # an idle worker may have claimed it already
    assert job["links"] == {"self": f"/v1/jobs/{job['id']}", "events": f"/v1/jobs/{job['id']}/events"}

    done = await wait_done(client, job["id"])

    assert done["status"] == "succeeded", done
    assert done["finish_reason"] == "length"
    assert done["attempts"] == 1
    assert done["worker"].endswith(str(worker.process.pid) + "-" + done["worker"].split("-")[-1])
    assert done["usage"]["completion_tokens"] == 16
    assert done["usage"]["prompt_tokens"] > 0
    assert done["usage"]["total_tokens"] == done["usage"]["prompt_tokens"] + 16
    assert done["output"]
    timings = done["timings"]
    assert 0 <= timings["queue_wait_s"] <= timings["ttft_s"] <= timings["total_s"]
    assert timings["time_per_output_token_s"] is not None


async def test_chat_messages_run_through_the_models_chat_template(
    client: httpx.AsyncClient, served: str
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    job = await submit(client, {"model": served, "messages": messages, "max_tokens": 4})
    done = await wait_done(client, job["id"])
    assert done["status"] == "succeeded"
    plain = await submit(client, {"model": served, "prompt": "Hi", "max_tokens": 4})
    plain = await wait_done(client, plain["id"])
    assert done["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the template added tokens


async def test_a_job_naming_no_model_runs_on_the_only_live_one_and_is_refused_when_several_are(
    own_fleet: Fleet, model_name: str
) -> None:
    async with httpx.AsyncClient(base_url=own_fleet.gateway_url, timeout=30) as client:
        refused = await client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 4})
        assert refused.status_code == 503, "no worker serves any model yet"
        own_fleet.start_worker(model_name)
        done = await wait_done(client, (await submit(client, {"prompt": "Hi", "max_tokens": 4}))["id"])
        assert (done["status"], done["model"]) == ("succeeded", model_name)
        other = own_fleet.start_worker(model_name + "-other")

        async def served(*names: str) -> bool:  # the gateway reads the registry at most every 0.5 s
            listed = (await client.get("/v1/models")).json()["data"]
            return sorted(m["id"] for m in listed) == sorted(names)

        await until_seen(lambda: served(model_name, model_name + "-other"), "both models listed", 10)
        ambiguous = await client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 4})
        assert ambiguous.status_code == 422
        error = ambiguous.json()["error"]
        assert error["param"] == "model"
        assert error["message"] == f"model: required, this fleet serves {model_name}, {model_name}-other"
        assert other.terminate() == 0
        await until_seen(lambda: served(model_name), "only the first model listed", 10)
        done = await wait_done(client, (await submit(client, {"prompt": "Hi", "max_tokens": 4}))["id"])
        assert (done["status"], done["model"]) == ("succeeded", model_name)


async def test_the_streamed_text_equals_the_final_output(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name)
    job = await submit(client, {"model": model_name, "prompt": "The quick brown fox", "max_tokens": 40})

    events = await read_events(client, job["id"])
    done = await wait_done(client, job["id"])

    kinds = [e.event for e in events]
    assert kinds[0] == "status" and events[0].data["status"] == "queued"
    assert "running" in [e.data.get("status") for e in events if e.event == "status"]
    assert kinds[-1] == "done" and events[-1].data["status"] == "succeeded"
    assert streamed_text(events) == done["output"]
    token_ids = [t for e in events if e.event == "token" for t in e.data["token_ids"]]
    assert len(token_ids) == done["usage"]["completion_tokens"] == 40
    assert [e.id for e in events] == sorted(
        {e.id for e in events}, key=lambda i: tuple(map(int, i.split("-")))
    )


async def test_resuming_after_a_last_event_id_yields_exactly_the_remaining_events(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name)
    job = await submit(client, {"model": model_name, "prompt": "Hello", "max_tokens": 30})
    everything = await read_events(client, job["id"])
    assert len(everything) > 10
    cut = len(everything) // 2

    by_header = await read_events(client, job["id"], headers={"Last-Event-ID": everything[cut].id})
    by_query = await read_events(client, job["id"], after=everything[cut].id)

    assert by_header == everything[cut + 1 :]
    assert by_query == everything[cut + 1 :]
    bad = await client.get(f"/v1/jobs/{job['id']}/events", params={"after": "yesterday"})
    assert bad.status_code == 422 and "after" in bad.json()["error"]["message"]


async def test_resuming_on_another_gateway_replica_continues_the_same_stream(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name)
    _, other_url = fleet.start_gateway()
    job = await submit(client, {"model": model_name, "prompt": "Hello", "max_tokens": 20})
    everything = await read_events(client, job["id"])
    async with httpx.AsyncClient(base_url=other_url, timeout=30) as other:
        rest = await read_events(other, job["id"], headers={"Last-Event-ID": everything[3].id})
    assert rest == everything[4:]


async def test_two_readers_follow_one_job_and_see_the_same_events(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name)
    job = await submit(client, {"model": model_name, "prompt": "Hello", "max_tokens": 60})
    first, second = await asyncio.gather(read_events(client, job["id"]), read_events(client, job["id"]))
    assert first == second
    assert first[-1].event == "done"


async def test_a_cancelled_queued_job_never_runs(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    worker = fleet.start_worker(model_name)
    worker.pause()  # the worker cannot claim anything: the job stays queued
    try:
        job = await submit(client, {"model": model_name, "prompt": "Hello", "max_tokens": 8})
        polled = (await client.get(f"/v1/jobs/{job['id']}")).json()
        assert polled["status"] == "queued" and polled["queue_position"] == 0
        reply = await client.delete(f"/v1/jobs/{job['id']}")
    finally:
        worker.resume()
    assert reply.status_code == 200
    assert reply.json()["status"] == "cancelled"
    after = await wait_done(
        client, (await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 4}))["id"]
    )
    assert after["status"] == "succeeded"  # the worker is back and has passed the cancelled job by
    cancelled = (await client.get(f"/v1/jobs/{job['id']}")).json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["attempts"] == 0 and cancelled["worker"] is None
    events = await read_events(client, job["id"])
    assert [e.event for e in events] == ["status", "done"]
    assert events[-1].data == {"type": "done", "status": "cancelled", "finish_reason": "cancelled"}


async def test_a_cancelled_running_job_stops_and_its_slot_is_reused(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    # The tiny model writes 480 tokens in tens of milliseconds: slow it down so the cancel lands mid-way.
    fleet.start_worker(model_name, "--max-batch-size", "1", env={"ORTFLEET_STEP_DELAY_S": "0.005"})
    job = await submit(client, {"model": model_name, "prompt": "Hello", "max_tokens": 480})
    events = []
    async with client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        async for line in stream.aiter_lines():
            if line == "event: token":
                reply = await client.delete(f"/v1/jobs/{job['id']}")
                assert reply.status_code in (200, 202)
                break
    events = await read_events(client, job["id"])

    done = await wait_done(client, job["id"])
    assert done["status"] == "cancelled" and done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] < 480
    assert events[-1].data["status"] == "cancelled"
    assert streamed_text(events) == done["output"]
    after = await wait_done(
        client, (await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 4}))["id"]
    )
    assert after["status"] == "succeeded" and after["worker"] == done["worker"]


async def test_eight_concurrent_jobs_on_one_worker_are_batched_together(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    worker = fleet.start_worker(model_name)
    models = (await client.get("/v1/models")).json()["data"]
    capacity = next(m["capacity"] for m in models if m["id"] == model_name)
    assert capacity >= 2
    worker.pause()  # all eight are queued before the worker looks
    try:
        jobs = await asyncio.gather(
            *(submit(client, {"model": model_name, "prompt": f"Job {i}", "max_tokens": 24}) for i in range(8))
        )
    finally:
        worker.resume()
    done = await asyncio.gather(*(wait_done(client, job["id"]) for job in jobs))
    assert all(job["status"] == "succeeded" for job in done)
    assert all(job["usage"]["completion_tokens"] == 24 for job in done)
    assert {job["engine_batch_peak"] for job in done} == {min(8, capacity)}


async def test_two_workers_share_one_models_queue(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    first = fleet.start_worker(model_name, "--max-batch-size", "2")
    second = fleet.start_worker(model_name, "--max-batch-size", "2")
    jobs = await asyncio.gather(
        *(submit(client, {"model": model_name, "prompt": f"Job {i}", "max_tokens": 64}) for i in range(16))
    )
    done = await asyncio.gather(*(wait_done(client, job["id"]) for job in jobs))
    assert all(job["status"] == "succeeded" for job in done)
    pids = {int(job["worker"].split("-")[-2]) for job in done}
    assert pids == {first.process.pid, second.process.pid}


async def test_an_idempotency_key_returns_the_same_job_on_retry(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str, redis: Redis
) -> None:
    fleet.start_worker(model_name)
    body = {"model": model_name, "prompt": "Hello", "max_tokens": 4}
    queue_before = await redis.dbsize()
    first = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": f"order-{model_name}"})
    again = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": f"order-{model_name}"})
    other = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": f"other-{model_name}"})
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert other.json()["id"] != first.json()["id"]
    assert (await redis.dbsize()) > queue_before
    done = await wait_done(client, first.json()["id"])
    assert done["attempts"] == 1


async def test_an_idempotency_key_reused_for_another_request_gets_422_naming_it(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name)
    headers = {"Idempotency-Key": f"reused-{model_name}"}
    body = {"model": model_name, "prompt": "Hello", "max_tokens": 4}
    first = await client.post("/v1/jobs", json=body, headers=headers)
    retry = await client.post("/v1/jobs", json=body, headers=headers)
    reused = await client.post("/v1/jobs", json={**body, "prompt": "Something else"}, headers=headers)
    assert first.status_code == retry.status_code == 202
    assert retry.json()["id"] == first.json()["id"]
    assert reused.status_code == 422
    error = reused.json()["error"]
    assert error["code"] == "idempotency_key_reused" and error["param"] == "Idempotency-Key"
    assert first.json()["id"] in error["message"]


async def test_every_key_of_a_job_expires(
    own_redis: object, tiny_model: object, own_redis_client: Redis, model_name: str
) -> None:
    # A Redis of its own: every key in it is this job's or the fleet's, none another test's.
    from tests.conftest import Fleet, RedisServer

    assert isinstance(own_redis, RedisServer)
    redis = own_redis_client
    fleet = Fleet(own_redis.url, tiny_model, env={"ORTFLEET_JOB_TTL_S": "120"})  # type: ignore[arg-type]
    try:
        fleet.start_gateway()
        fleet.start_worker(model_name)
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as client:
            job = await submit(
                client,
                {"model": model_name, "prompt": "Hi", "max_tokens": 4},
                **{"Idempotency-Key": model_name},
            )
            await wait_done(client, job["id"])
        keys = [k async for k in redis.scan_iter("*")]
        job_keys = [k for k in keys if job["id"] in k]
        assert len(job_keys) == 2  # record and event stream; the arq job key is gone once it ran
        for key in keys:
            ttl = await redis.ttl(key)
            assert ttl != -1, f"{key} never expires"
        for key in job_keys:
            assert 0 < await redis.ttl(key) <= 120
    finally:
        fleet.stop_all()


async def first_token(client: httpx.AsyncClient, job_id: str) -> None:
    """Returns once the job's stream holds its first token: the job runs."""
    async with aconnect_sse(client, "GET", f"/v1/jobs/{job_id}/events") as source:
        async for sse in source.aiter_sse():
            if sse.event == "token":
                return
            assert sse.event not in ("done", "error"), sse.data


async def test_a_job_keeps_its_data_while_it_runs_and_the_job_ttl_counts_from_its_end(
    own_redis: RedisServer, tiny_model: Path, own_redis_client: Redis, model_name: str
) -> None:
    # A Redis of its own: no other test's job keeps the anonymous owner's index alive.
    redis, ttl_s, keys = own_redis_client, 60, STANDALONE
    fleet = Fleet(own_redis.url, tiny_model, env={"ORTFLEET_JOB_TTL_S": str(ttl_s)})
    try:
        fleet.start_gateway()
        fleet.start_worker(model_name, env={"ORTFLEET_STEP_DELAY_S": "0.05"})
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as client:
            body = {"model": model_name, "prompt": "Hi", "max_tokens": 40, "ignore_eos": True}
            job = await submit(client, body, **{"Idempotency-Key": model_name})
            await first_token(client, job["id"])
            record = await redis.hgetall(keys.job(job["id"]))  # type: ignore[misc]
            living = [keys.job(job["id"]), keys.events(job["id"]), keys.arq_job(job["id"])]
            living += [record["idempotency_key"], keys.owner_jobs(record["owner"])]
            running = {key: await redis.ttl(key) for key in living}
            done = await wait_done(client, job["id"])
        ended = {key: await redis.ttl(key) for key in living}
    finally:
        fleet.stop_all()
    assert done["status"] == "succeeded", done
    assert running == dict.fromkeys(living, -1)  # -1: the key exists and has no expiry
    assert ended[keys.arq_job(job["id"])] == -2  # the payload goes when the job ends
    for key in living[:2] + living[3:]:
        assert 0 < ended[key] <= ttl_s, (key, ended[key])


async def test_a_fleet_on_a_unix_socket_url_serves_a_streamed_job(tmp_path: Path, tiny_model: Path) -> None:
    socket = tmp_path / "redis.sock"
    redis = start_redis(free_port(), tmp_path / "redis", unix_socket=socket, log=LOGS / "redis-unix.log")
    fleet = Fleet(f"unix://{socket}?db=0", tiny_model)
    try:
        fleet.start_gateway()
        fleet.start_worker("tiny-unix-socket")
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as client:
            job = await submit(client, {"model": "tiny-unix-socket", "prompt": "Hello", "max_tokens": 8})
            events = await read_events(client, job["id"])
            done = await wait_done(client, job["id"])
    finally:
        fleet.stop_all()
        stop(redis)
    assert done["status"] == "succeeded" and done["usage"]["completion_tokens"] == 8
    assert streamed_text(events) == done["output"]
