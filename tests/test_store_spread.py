"""How a model over two equal Redis stores shares out work: a burst of jobs lands evenly on both, and a
request's choices, which all go to one store, ask no more than one store's share of a key's jobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from redis.asyncio import Redis

from common.store_epoch import epoch_of
from ortfleet.fleet.launcher import FleetProcess
from tests.conftest import Fleet, RedisServer, keys
from tests.jobs_client import submit


@dataclass
class TwoStores:
    """A fleet of one model over two stores with a worker each, and alice's client."""

    client: httpx.AsyncClient
    stores: list[str]  # their URLs: `store 1` (the fleet's home Redis), then `store 2`
    epochs: list[str]  # what the ids of each store's jobs carry
    workers: list[FleetProcess]  # the first store's worker, then the second's

    def store_of(self, job_id: str) -> int:
        """1 or 2, as /readyz names the store that holds the job."""
        return self.epochs.index(epoch_of(job_id)) + 1


@contextlib.asynccontextmanager
async def two_stores(
    redis_server: RedisServer,
    own_redis: RedisServer,
    tiny_model: Path,
    model_name: str,
    env: dict[str, str] | None = None,
) -> AsyncIterator[TwoStores]:
    stores = [redis_server.url, own_redis.url]
    token = f"sk-alice-{model_name[-8:]}-0123456789"
    env = {
        "ORTFLEET_REDIS_SHARDS": json.dumps({model_name: stores}),
        "ORTFLEET_API_KEYS": f"alice-{model_name[-8:]}:{token}",
        "ORTFLEET_HEARTBEAT_TTL_S": "15",  # a paused worker stays registered
        **(env or {}),
    }
    with Fleet(redis_server.url, tiny_model, env=env) as fleet:
        _, url = fleet.start_gateway()
        workers = [fleet.start_worker(model_name, env={"ORTFLEET_STORE": n}) for n in ("1", "2")]
        fleet.wait_workers(model_name, 2)
        epochs = []
        for store in stores:
            async with Redis.from_url(store, decode_responses=True) as redis:
                epochs.append(await redis.get(keys.epoch))
        async with httpx.AsyncClient(
            base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"}
        ) as client:
            yield TwoStores(client, stores, epochs, workers)


async def test_a_burst_of_jobs_spreads_evenly_over_a_models_two_stores(
    redis_server: RedisServer, own_redis: RedisServer, tiny_model: Path, model_name: str
) -> None:
    """Sixteen jobs submitted at once, while the gateway's view of the fleet is stale, land eight and
    eight (one either way at most): the concurrent submissions share one read of the registry, and the
    jobs placed meanwhile count on their stores. The workers are held, so each store's queue shows what
    it took."""
    async with two_stores(redis_server, own_redis, tiny_model, model_name) as fleet:
        await asyncio.sleep(0.6)  # the gateway's registry snapshot is older than its 0.5 s
        for worker in fleet.workers:
            worker.pause()
        try:
            body = {"model": model_name, "max_tokens": 2}
            burst = await asyncio.gather(
                *(submit(fleet.client, {**body, "prompt": f"Hello {i}"}) for i in range(16))
            )
        finally:
            for worker in fleet.workers:
                worker.resume()
        split = Counter(fleet.store_of(job["id"]) for job in burst)
        assert abs(split[1] - split[2]) <= 2, f"the burst split {split[1]}/{split[2]}"


async def test_more_choices_than_one_stores_share_of_the_keys_active_jobs_get_400_at_once(
    redis_server: RedisServer, own_redis: RedisServer, tiny_model: Path, model_name: str
) -> None:
    """A key may hold 4 active jobs, 2 on each of the model's 2 stores; a request's choices all go to
    one store, so n: 3 could never be admitted: 400 too_many_choices naming the share, and no job made,
    rather than a 429 to retry forever. n: 2 runs."""
    env = {"ORTFLEET_KEY_MAX_CONCURRENT_JOBS": "4"}
    async with two_stores(redis_server, own_redis, tiny_model, model_name, env) as fleet:
        chat = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        refused = await fleet.client.post("/v1/chat/completions", json={**chat, "n": 3})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "too_many_choices" and error["param"] == "n"
        assert "2 active jobs" in error["message"] and "4" in error["message"], error["message"]
        assert "Retry-After" not in refused.headers
        assert (await fleet.client.get("/v1/jobs")).json()["data"] == []  # no job was made
        answered = await fleet.client.post("/v1/chat/completions", json={**chat, "n": 2})
        assert answered.status_code == 200, answered.text
        assert len(answered.json()["choices"]) == 2
