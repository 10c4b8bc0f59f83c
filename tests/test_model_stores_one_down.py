"""One of a model's two Redis stores down: what the routes that span every store still answer, and how
they say which store they could not reach."""

from __future__ import annotations

import asyncio
from pathlib import Path

from redis.asyncio import Redis

from tests.conftest import RedisServer
from tests.jobs_client import submit
from tests.test_model_stores import key_homed_on
from tests.test_store_spread import two_stores


async def test_an_idempotent_job_whose_keys_home_store_is_down_is_told_which_store_and_when_to_retry(
    redis_server: RedisServer, own_redis: RedisServer, tiny_model: Path, model_name: str
) -> None:
    """A key's home store decides whether a try of the key queued its job anywhere; while it is down the
    try is answered 503 naming that store as /readyz does, never its address, with Retry-After. A key
    whose home store answers, and a job without a key, go to the store that is up."""
    async with two_stores(redis_server, own_redis, tiny_model, model_name) as fleet:
        owner = f"alice-{model_name[-8:]}"
        body = {"model": model_name, "prompt": "Hi", "max_tokens": 2}
        own_redis.stop()
        homed_down = key_homed_on(fleet.stores, 1, owner, "down")
        refused = await fleet.client.post("/v1/jobs", json=body, headers={"Idempotency-Key": homed_down})
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "store_unavailable"
        assert "store 2" in error["message"] and "Idempotency-Key" in error["message"], error["message"]
        assert str(own_redis.port) not in refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        homed_up = key_homed_on(fleet.stores, 0, owner, "up")
        served = await submit(fleet.client, body, **{"Idempotency-Key": homed_up})
        assert fleet.store_of(served["id"]) == 1
        assert fleet.store_of((await submit(fleet.client, body))["id"]) == 1


async def test_the_job_list_shows_the_jobs_of_the_stores_that_answer_and_names_those_that_do_not(
    redis_server: RedisServer, own_redis: RedisServer, tiny_model: Path, model_name: str
) -> None:
    async with two_stores(redis_server, own_redis, tiny_model, model_name) as fleet:
        owner = f"alice-{model_name[-8:]}"
        body = {"model": model_name, "prompt": "Hi", "max_tokens": 2}
        homed = [
            key_homed_on(fleet.stores, home, owner, tag)
            for home, tag in ((0, "a"), (0, "b"), (1, "c"), (1, "d"))
        ]
        jobs = await asyncio.gather(
            *(submit(fleet.client, body, **{"Idempotency-Key": key}) for key in homed)
        )
        on = {store: {job["id"] for job in jobs if fleet.store_of(job["id"]) == store} for store in (1, 2)}
        assert on[1] and on[2], on
        whole = (await fleet.client.get("/v1/jobs")).json()
        assert {job["id"] for job in whole["data"]} == on[1] | on[2]
        assert whole["unreachable_stores"] == []

        own_redis.stop()
        listed = await fleet.client.get("/v1/jobs")
        assert listed.status_code == 200, listed.text
        page = listed.json()
        assert {job["id"] for job in page["data"]} == on[1]
        assert page["unreachable_stores"] == ["store 2"]
        assert str(own_redis.port) not in listed.text

        own_redis.start()
        async with Redis.from_url(fleet.stores[1]) as back:
            await back.ping()
        again = (await fleet.client.get("/v1/jobs")).json()
        assert {job["id"] for job in again["data"]} == on[1] | on[2]
        assert again["unreachable_stores"] == []
