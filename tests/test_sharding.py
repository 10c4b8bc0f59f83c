"""Sharding by model: a model given a Redis of its own (ORTFLEET_REDIS_SHARDS) keeps its queue, jobs,
streams and workers there, and one gateway serves every model as before."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from redis.asyncio import Redis

from common.gateway_settings import GatewaySettings
from ortfleet.fleet.processes import free_port
from tests.conftest import Fleet, RedisServer, keys
from tests.jobs_client import read_events, streamed_text, submit, wait_done


async def all_keys(redis: Redis) -> list[str]:
    return [key async for key in redis.scan_iter(count=1000)]


async def test_a_sharded_model_lives_on_its_own_redis_behind_the_same_gateway(
    redis_server: RedisServer, own_redis: RedisServer, redis: Redis, own_redis_client: Redis,
    tiny_model: Path, model_name: str,
) -> None:  # fmt: skip
    home_model, own_model = f"{model_name}-home", f"{model_name}-own"
    fleet = Fleet(
        redis_server.url, tiny_model, env={"ORTFLEET_REDIS_SHARDS": json.dumps({own_model: own_redis.url})}
    )
    try:
        _, url = fleet.start_gateway()
        fleet.start_worker(home_model)
        # It registers on its shard, where the gateway looks; slowed, so a cancel lands mid-way.
        fleet.start_worker(own_model, env={"ORTFLEET_STEP_DELAY_S": "0.005"})
        fleet.wait_workers(own_model, 1)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            models = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
            assert {home_model, own_model} <= models
            jobs = {
                model: [
                    (await submit(client, {"model": model, "prompt": f"Hello {i}", "max_tokens": 8}))["id"]
                    for i in range(2)
                ]
                for model in (home_model, own_model)
            }
            events = await read_events(client, jobs[own_model][0])
            assert events[-1].event == "done"
            done = {job_id: await wait_done(client, job_id) for ids in jobs.values() for job_id in ids}
            assert {job["status"] for job in done.values()} == {"succeeded"}
            assert streamed_text(events) == done[jobs[own_model][0]]["output"]

            # The caller's job list spans both Redis, newest first, one job a page.
            listed, cursor = [], None
            while True:
                page = (
                    await client.get("/v1/jobs", params={"limit": 1, **({"after": cursor} if cursor else {})})
                ).json()
                listed += [job["id"] for job in page["data"]]
                if not page["has_more"]:
                    break
                cursor = page["next_cursor"]
            mine = [job_id for job_id in listed if job_id in done]
            assert sorted(mine) == sorted(done)
            created = [done[job_id]["created_at"] for job_id in mine]
            assert created == sorted(created, reverse=True)

            # Cancelling and the OpenAI API reach the sharded model's jobs too.
            slow = await submit(
                client, {"model": own_model, "prompt": "Hi", "max_tokens": 480, "ignore_eos": True}
            )
            cancelled = await client.delete(f"/v1/jobs/{slow['id']}")
            assert cancelled.status_code in (200, 202), cancelled.text
            assert (await wait_done(client, slow["id"]))["status"] == "cancelled"
            openai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            chat = await openai.chat.completions.create(
                model=own_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert chat.choices[0].finish_reason in ("stop", "length")
            metrics = (await client.get("/metrics")).text
            assert f'ortfleet_workers_live{{model="{own_model}"}} 1.0' in metrics

        own_ids = [*jobs[own_model], slow["id"]]
        home_keys, shard_keys = await all_keys(redis), await all_keys(own_redis_client)
        assert all(keys.job(job_id) in shard_keys and keys.events(job_id) in shard_keys for job_id in own_ids)
        assert all(keys.job(job_id) in home_keys for job_id in jobs[home_model])
        assert not [key for key in home_keys if own_model in key or any(job_id in key for job_id in own_ids)]
        assert not [key for key in shard_keys if home_model in key or any(j in key for j in jobs[home_model])]
        assert not set(own_ids) & set(await redis.zrange(keys.owner_jobs(""), 0, -1))
    finally:
        fleet.stop_all()


@pytest.mark.unit
def test_the_shard_map_is_checked_at_startup_and_masked_when_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.settings import effective_settings

    monkeypatch.setenv("ORTFLEET_REDIS_SHARDS", json.dumps({"big": "redis://:hunter2@10.0.0.9:6379/0"}))
    settings = GatewaySettings()
    assert [store.url for store in settings.stores_for("big")] == ["redis://:hunter2@10.0.0.9:6379/0"]
    assert [store.url for store in settings.stores_for("other")] == [settings.redis_url.get_secret_value()]
    assert effective_settings(settings)["redis_shards"] == {"big": "redis://:****@10.0.0.9:6379/0"}
    monkeypatch.setenv("ORTFLEET_REDIS_SHARDS", json.dumps({"big": "10.0.0.9:6379"}))
    with pytest.raises(ValueError, match=r"the Redis of model 'big': .*scheme"):
        GatewaySettings()
    monkeypatch.setenv("ORTFLEET_REDIS_SHARDS", "big=redis://x")
    with pytest.raises(ValueError, match="redis_shards"):
        GatewaySettings()


async def test_a_gateway_with_an_unreachable_shard_stays_ready_for_the_other_models_and_says_so(
    redis_server: RedisServer, tiny_model: Path, model_name: str
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    fleet = Fleet(redis_server.url, tiny_model, env={"ORTFLEET_REDIS_SHARDS": json.dumps({model_name: dead})})
    try:
        _, url = fleet.start_gateway()
        fleet.start_worker(f"{model_name}-home")
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            # The home Redis serves its models: ready, the other store named in the warnings.
            ready = await client.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert any("Redis is unreachable (store 2)" in line for line in ready.json()["warnings"])
            job = await submit(client, {"model": f"{model_name}-home", "prompt": "Hi", "max_tokens": 4})
            assert (await wait_done(client, job["id"]))["status"] == "succeeded"
            shard_job = await client.post("/v1/jobs", json={"model": model_name, "prompt": "Hi"})
            assert shard_job.status_code in (404, 503), shard_job.text
        fleet.stop_all()
        # Without its home Redis a gateway is not ready.
        fleet = Fleet(dead, tiny_model)
        _, url = fleet.start_gateway()
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            ready = await client.get("/readyz")
            assert ready.status_code == 503
            assert "Redis is unreachable (store 1)" in ready.json()["reason"]
    finally:
        fleet.stop_all()
