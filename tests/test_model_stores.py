"""One model over several Redis stores (ORTFLEET_REDIS_SHARDS with a list of URLs): each worker serves
one store, gateways place each job on the store with the most free rows, and every route finds a job on
whichever store holds it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from openai import AsyncOpenAI
from redis.asyncio import Redis

from common.apikeys import Principal
from common.gateway_settings import GatewaySettings
from common.store_epoch import epoch_of
from gateway.fleet import FleetSnapshot, ModelState
from gateway.idempotency import idempotency_digest
from gateway.placement import Placement, key_home, share_of_limit
from gateway.shards import Shard
from tests.conftest import Fleet, RedisServer, keys
from tests.jobs_client import read_events, streamed_text, submit, wait_done
from tests.sentinel_group import Reader, SentinelGroup
from tests.test_cli import ortfleet
from tests.test_prefix_routing import conversation, follow_up, run
from tests.waiting import until, until_seen


async def jobs_held(redis: Redis, job_ids: list[str]) -> set[str]:
    async with redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.exists(keys.job(job_id))
        found = await pipe.execute()
    return {job_id for job_id, there in zip(job_ids, found, strict=True) if there}


async def test_a_model_over_two_stores_spreads_its_jobs_over_both_and_every_route_finds_them(
    redis_server: RedisServer, own_redis: RedisServer, redis: Redis, own_redis_client: Redis,
    tiny_model: Path, model_name: str,
) -> None:  # fmt: skip
    stores = {model_name: [redis_server.url, own_redis.url]}
    fleet = Fleet(redis_server.url, tiny_model, env={"ORTFLEET_REDIS_SHARDS": json.dumps(stores)})
    try:
        _, url = fleet.start_gateway()
        first = fleet.start_worker(model_name, env={"ORTFLEET_STORE": "1"})
        # No store named: it takes the one with the fewest workers of the model, the second.
        second = fleet.start_worker(model_name, env={"ORTFLEET_STEP_DELAY_S": "0.005"})
        fleet.wait_workers(model_name, 2)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            overview = (await client.get("/v1/fleet")).json()
            [model] = [m for m in overview["models"] if m["id"] == model_name]
            assert model["workers"] == 2
            # Each worker is shown with the Redis it serves, named as /readyz names them.
            assert sorted(w["store"] for w in overview["workers"] if w["model"] == model_name) == [
                "store 1",
                "store 2",
            ]
            body = {"model": model_name, "max_tokens": 12, "ignore_eos": True}
            submitted = await asyncio.gather(
                *(submit(client, {**body, "prompt": f"Hello {i}"}) for i in range(8))
            )
            ids = [job["id"] for job in submitted]
            on_first, on_second = await jobs_held(redis, ids), await jobs_held(own_redis_client, ids)
            assert on_first and on_second, "the jobs went to one store only"
            assert on_first | on_second == set(ids) and not on_first & on_second
            # Streams, records and the caller's list reach the jobs on either store.
            for job_id in (next(iter(on_first)), next(iter(on_second))):
                events = await read_events(client, job_id)
                assert events[-1].event == "done"
                assert streamed_text(events) == (await wait_done(client, job_id))["output"]
            done = [await wait_done(client, job_id) for job_id in ids]
            assert {job["status"] for job in done} == {"succeeded"}
            listed = (await client.get("/v1/jobs", params={"limit": 100})).json()["data"]
            assert set(ids) <= {job["id"] for job in listed}
            workers = {w["id"]: w for w in overview["workers"] if w["model"] == model_name}
            assert len(workers) == 2
            # `ortfleet status` reads every Redis of the shard map: both workers, the jobs of both stores.
            shown = ortfleet("status", "--json", env={"ORTFLEET_REDIS_URL": redis_server.url, **fleet.env})
            assert shown.returncode == 0, shown.stderr
            status = json.loads(shown.stdout)
            assert {w["id"] for w in status["workers"] if w["model"] == model_name} == set(workers)
            [row] = [m for m in status["models"] if m["name"] == model_name]
            assert row["workers"] == 2 and row["finished_last_minute"] >= len(ids)

            # A cancel reaches the job on the second store (its worker steps slowly).
            await idle(client, model_name)
            slow = [
                await submit(client, {**body, "prompt": f"Slow {i}", "max_tokens": 400}) for i in range(4)
            ]
            there = await jobs_held(own_redis_client, [job["id"] for job in slow])
            assert there, "no job of four went to the second store"
            job_id = next(iter(there))
            assert (await client.delete(f"/v1/jobs/{job_id}")).status_code in (200, 202)
            assert (await wait_done(client, job_id))["status"] == "cancelled"
            for job in slow:
                await client.delete(f"/v1/jobs/{job['id']}")

            # A chat's next turn goes to the store whose worker holds its first turn's prompt.
            openings = [await run(client, model_name, conversation(k)) for k in range(4)]
            assert len({epoch_of(opening["id"]) for opening in openings}) == 2, (
                "the first turns used one store"
            )
            for k, opening in reversed(list(enumerate(openings))):  # not the order placement would take
                turn = await run(client, model_name, follow_up(conversation(k), opening["output"]))
                assert epoch_of(turn["id"]) == epoch_of(opening["id"]) and turn["worker"] == opening["worker"]
                assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

            # A request's choices go to one store, and the OpenAI SDK gets them all.
            openai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            chat = await openai.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=3
            )
            assert sorted(choice.index for choice in chat.choices) == [0, 1, 2]
            assert all(choice.finish_reason in ("stop", "length") for choice in chat.choices)
            metrics = (await client.get("/metrics")).text
            assert f'ortfleet_workers_live{{model="{model_name}"}} 2.0' in metrics

            # With the second store's worker gone, every job goes to the first store.
            second.process.send_signal(signal.SIGTERM)
            second.process.wait(timeout=60)
            fleet.wait_workers(model_name, 1)
            await asyncio.sleep(0.6)  # the gateway's registry snapshot is at most 0.5 s old
            later = [(await submit(client, {**body, "prompt": f"Later {i}"}))["id"] for i in range(6)]
            assert await jobs_held(redis, later) == set(later)
            assert {(await wait_done(client, job_id))["status"] for job_id in later} == {"succeeded"}

            # With the second store's Redis down too, the model is served from the first.
            own_redis.process.kill()
            own_redis.process.wait(timeout=10)
            await asyncio.sleep(0.6)
            last = [(await submit(client, {**body, "prompt": f"Last {i}"}))["id"] for i in range(4)]
            assert {(await wait_done(client, job_id))["status"] for job_id in last} == {"succeeded"}
            assert first.alive()
    finally:
        fleet.stop_all()


async def test_a_keys_active_jobs_limit_holds_over_the_stores_with_each_store_its_share(
    redis_server: RedisServer,
    own_redis: RedisServer,
    own_redis_client: Redis,
    tiny_model: Path,
    model_name: str,
) -> None:
    """A key may have 2 active jobs: each of the 2 stores takes 1, and a third is refused naming the key's
    whole limit; with one store's worker gone, a job never waits on that store."""
    stores = {model_name: [redis_server.url, own_redis.url]}
    key = "sk-stores-" + model_name[-8:]
    env = {
        "ORTFLEET_REDIS_SHARDS": json.dumps(stores),
        "ORTFLEET_API_KEYS": f"alice:{key}",
        "ORTFLEET_KEY_MAX_CONCURRENT_JOBS": "2",
        "ORTFLEET_STEP_DELAY_S": "0.02",
    }
    with Fleet(redis_server.url, tiny_model, env=env) as fleet:
        _, url = fleet.start_gateway()
        _, second = (fleet.start_worker(model_name, env={"ORTFLEET_STORE": n}) for n in ("1", "2"))
        fleet.wait_workers(model_name, 2)
        async with httpx.AsyncClient(
            base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"}
        ) as client:
            body = {"model": model_name, "prompt": "Long", "max_tokens": 400, "ignore_eos": True}
            taken = [await submit(client, body) for _ in range(2)]
            assert len({epoch_of(job["id"]) for job in taken}) == 2, "both active jobs on one store"
            refused = await client.post("/v1/jobs", json=body)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "too_many_active_jobs" and "limit of 2 active jobs" in error["message"]
            for job in taken:
                await client.delete(f"/v1/jobs/{job['id']}")
            assert {(await wait_done(client, job["id"]))["status"] for job in taken} == {"cancelled"}

            # With the second store's worker gone, its share is out of reach: the first store takes one
            # job, and the next is refused rather than left waiting on a store nobody serves.
            second.process.send_signal(signal.SIGTERM)
            second.process.wait(timeout=60)
            fleet.wait_workers(model_name, 1)
            await asyncio.sleep(0.6)  # the gateway's registry snapshot is at most 0.5 s old
            alone = await submit(client, body)
            refused = await client.post("/v1/jobs", json=body)
            assert refused.status_code == 429, refused.text
            assert await jobs_held(own_redis_client, [alone["id"]]) == set()
            await client.delete(f"/v1/jobs/{alone['id']}")


def key_homed_on(stores: list[str], home: int, owner: str, tag: str) -> str:
    """An Idempotency-Key of `owner` whose home store (gateway/placement.py's key_home) is stores[home]."""
    labels = [SimpleNamespace(label=url) for url in stores]
    for n in itertools.count():
        key = f"{tag}-{n}"
        idem = idempotency_digest(Principal(owner), key)
        if key_home(cast(list[Shard], labels), idem) is labels[home]:
            return key
    raise AssertionError("unreachable")


@dataclass
class HomeShareHeld:
    """A fleet of one model over two stores, a worker each, where alice may hold one active job a store,
    and a job of hers holds the share of the first store: her next keyed job whose home is that store goes
    to the second one."""

    client: httpx.AsyncClient  # alice's
    stores: list[str]
    home_epoch: str  # what the ids of the home store's jobs carry
    body: dict[str, Any]  # a job that runs for a while
    holder: str  # the job that holds the home store's share


@contextlib.asynccontextmanager
async def home_share_held(
    redis_server: RedisServer, own_redis: RedisServer, tiny_model: Path, model_name: str
) -> AsyncIterator[HomeShareHeld]:
    stores = [redis_server.url, own_redis.url]
    token = f"sk-home-{model_name[-8:]}-0123456789"
    env = {
        "ORTFLEET_REDIS_SHARDS": json.dumps({model_name: stores}),
        "ORTFLEET_API_KEYS": f"alice:{token}",
        "ORTFLEET_KEY_MAX_CONCURRENT_JOBS": "2",  # a share of 1 a store
        "ORTFLEET_STEP_DELAY_S": "0.02",
    }
    with Fleet(redis_server.url, tiny_model, env=env) as fleet:
        _, url = fleet.start_gateway()
        for n in ("1", "2"):
            fleet.start_worker(model_name, env={"ORTFLEET_STORE": n})
        fleet.wait_workers(model_name, 2)
        async with Redis.from_url(redis_server.url, decode_responses=True) as home:
            home_epoch = await home.get(keys.epoch)
        async with httpx.AsyncClient(
            base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"}
        ) as client:
            body = {"model": model_name, "prompt": "Long", "max_tokens": 400, "ignore_eos": True}
            holder = await submit(
                client, body, **{"Idempotency-Key": key_homed_on(stores, 0, "alice", f"holder-{model_name}")}
            )
            assert epoch_of(holder["id"]) == home_epoch
            yield HomeShareHeld(client, stores, home_epoch, body, holder["id"])


async def test_a_retry_never_makes_a_second_job_while_the_store_its_first_try_went_to_is_down(
    redis_server: RedisServer,
    own_redis: RedisServer,
    tiny_model: Path,
    model_name: str,
) -> None:
    """The key's home store refuses the first try (its owner's share of active jobs is held there), so
    the job goes to the second store. With that store down, a retry is answered 503, not queued on the
    home store as a second job; once it is back, the retry finds the first job. A key that never went
    there is served meanwhile."""
    async with home_share_held(redis_server, own_redis, tiny_model, model_name) as held:
        client, body = held.client, held.body
        keyed = {tag: key_homed_on(held.stores, 0, "alice", tag) for tag in ("order", "other")}
        first = await submit(client, body, **{"Idempotency-Key": keyed["order"]})
        assert epoch_of(first["id"]) != held.home_epoch, "the home store took it: its share was free"
        await client.delete(f"/v1/jobs/{held.holder}")  # the home store would take a job now
        assert (await wait_done(client, held.holder))["status"] == "cancelled"

        own_redis.stop()
        retry = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": keyed["order"]})
        assert retry.status_code == 503, retry.text
        assert retry.json()["error"]["code"] == "store_unavailable"
        assert "Idempotency-Key" in retry.json()["error"]["message"]
        assert "store 2" in retry.json()["error"]["message"]  # as /readyz names it, never its address
        served = await submit(client, {**body, "max_tokens": 2}, **{"Idempotency-Key": keyed["other"]})
        assert epoch_of(served["id"]) == held.home_epoch

        own_redis.start()

        replies: list[httpx.Response] = []

        async def replayed() -> bool:
            again = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": keyed["order"]})
            replies.append(again)
            return again.status_code != 503

        await until_seen(replayed, "the retry answered once the store is back", timeout_s=30)
        again = replies[-1]
        assert again.status_code == 202, again.text
        assert again.json()["id"] == first["id"] and again.headers["Idempotent-Replayed"] == "true"
        await client.delete(f"/v1/jobs/{first['id']}")


async def test_tries_of_one_key_go_one_at_a_time_over_the_stores(
    redis_server: RedisServer,
    own_redis: RedisServer,
    own_redis_client: Redis,
    redis: Redis,
    tiny_model: Path,
    model_name: str,
) -> None:
    """The key's home store refuses its first try (the owner's share of active jobs is held there), and
    the second store holds it (writes paused). A second try of the key meanwhile gets 409
    idempotency_key_in_use rather than a look of its own, which could find no job and queue one; once the
    first try is answered, every try returns its job."""
    async with home_share_held(redis_server, own_redis, tiny_model, model_name) as held:
        client, body = held.client, held.body
        key = key_homed_on(held.stores, 0, "alice", "once")
        trying = keys.idempotency_try(idempotency_digest(Principal("alice"), key))

        async def token_held() -> bool:
            return bool(await redis.exists(trying))

        await own_redis_client.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
        try:
            first = asyncio.create_task(client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key}))
            await until_seen(token_held, "the first try's token on the key's home store", timeout_s=15)
            second = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
            assert second.status_code == 409, second.text
            assert second.json()["error"]["code"] == "idempotency_key_in_use"
            assert second.headers["Retry-After"] == "1"
            assert not first.done()
        finally:
            await own_redis_client.execute_command("CLIENT", "UNPAUSE")
        answered = await first
        assert answered.status_code == 202, answered.text
        job = answered.json()["id"]
        assert epoch_of(job) != held.home_epoch, "the home store took it: its share was free"
        assert not await token_held(), "the try's token outlived it"
        again = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
        assert again.status_code == 202 and again.json()["id"] == job, again.text
        assert again.headers["Idempotent-Replayed"] == "true"
        for done in (held.holder, job):
            await client.delete(f"/v1/jobs/{done}")


async def test_fair_share_and_priorities_keep_their_meaning_over_the_stores(
    redis_server: RedisServer,
    own_redis: RedisServer,
    redis: Redis,
    own_redis_client: Redis,
    tiny_model: Path,
    model_name: str,
) -> None:
    """One row a store, both workers held while the jobs arrive: a key that floods both stores with batch
    jobs does not hold back another key's batch jobs, nor anyone's interactive jobs, on either store."""
    stores = {model_name: [redis_server.url, own_redis.url]}
    tokens = {name: f"sk-{name}-{model_name[-8:]}-0123456789" for name in ("alice", "bob")}
    env = {
        "ORTFLEET_REDIS_SHARDS": json.dumps(stores),
        "ORTFLEET_API_KEYS": ",".join(f"{name}:{token}" for name, token in tokens.items()),
        "ORTFLEET_MAX_BATCH_SIZE": "1",
    }
    with Fleet(redis_server.url, tiny_model, env=env) as fleet:
        _, url = fleet.start_gateway()
        workers = [fleet.start_worker(model_name, env={"ORTFLEET_STORE": n}) for n in ("1", "2")]
        fleet.wait_workers(model_name, 2)
        for worker in workers:
            worker.pause()
        try:
            clients = {
                name: httpx.AsyncClient(
                    base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"}
                )
                for name, token in tokens.items()
            }
            body = {"model": model_name, "prompt": "Hi", "max_tokens": 2, "priority": "batch"}
            flood = [(await submit(clients["alice"], body))["id"] for _ in range(12)]
            later = [(await submit(clients["bob"], body))["id"] for _ in range(4)]
            urgent = [
                (await submit(clients["alice"], {**body, "priority": "interactive"}))["id"] for _ in range(2)
            ]
        finally:
            for worker in workers:
                worker.resume()
        for name, job_ids in (("alice", flood + urgent), ("bob", later)):
            assert {(await wait_done(clients[name], job_id))["status"] for job_id in job_ids} == {"succeeded"}
        for client in clients.values():
            await client.aclose()
    started: dict[str, list[tuple[float, str]]] = {}  # store -> (started_at, job id)
    for store, client in (("1", redis), ("2", own_redis_client)):
        for job_id in await jobs_held(client, flood + later + urgent):
            record = await client.hgetall(keys.job(job_id))  # type: ignore[misc]
            started.setdefault(store, []).append((float(record["started_at"]), job_id))
    assert len(started) == 2, "the jobs went to one store only"
    for store, runs in started.items():
        order = [job_id for _, job_id in sorted(runs)]
        interactive = [job_id for job_id in order if job_id in urgent]
        assert order[: len(interactive)] == interactive, f"store {store}: interactive jobs waited"
        batch = [job_id for job_id in order if job_id not in urgent]
        bobs = [i for i, job_id in enumerate(batch) if job_id in later]
        # Fair share alternates the keys: each of bob's jobs is among the first two per job of his.
        assert bobs and max(bobs) < 2 * len(bobs), f"store {store}: {batch} (bob's at {bobs})"


@pytest.mark.slow
async def test_a_stores_primary_killed_mid_load_loses_no_job_and_the_other_store_goes_on(
    redis_server: RedisServer, own_redis: RedisServer, own_redis_client: Redis, sentinels: SentinelGroup,
    tiny_model: Path, model_name: str,
) -> None:  # fmt: skip
    """The second store is a primary with a replica under Sentinel: its primary is killed (SIGKILL) while
    jobs stream on both stores; every job ends succeeded, each stream with no gap or duplicate. Every
    store has a replica, so that each submission is confirmed by one (ORTFLEET_SUBMIT_REPLICAS)."""
    replica_of_first = sentinels.start_redis("--replicaof", "127.0.0.1", str(own_redis.port))
    sentinels.wait_until(
        lambda: sentinels.replica_synced(replica_of_first), "the first store's replica syncs"
    )
    stores = {model_name: [own_redis.url, sentinels.url]}
    env = {
        "ORTFLEET_REDIS_SHARDS": json.dumps(stores),
        "ORTFLEET_SUBMIT_REPLICAS": "1",
        "ORTFLEET_STEP_DELAY_S": "0.02",
        "ORTFLEET_HEARTBEAT_TTL_S": "15",  # the failover takes seconds: the worker keeps its jobs
    }
    with Fleet(redis_server.url, tiny_model, env=env) as fleet:
        fleet.start_gateway()
        for store in ("1", "2"):
            fleet.start_worker(model_name, env={"ORTFLEET_STORE": store})
        fleet.wait_workers(model_name, 2)
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=120) as client:
            body = {"model": model_name, "max_tokens": 200, "ignore_eos": True}
            jobs = [await submit(client, {**body, "prompt": f"Story {i}:"}) for i in range(6)]
            on_first = await jobs_held(own_redis_client, [job["id"] for job in jobs])
            assert 0 < len(on_first) < len(jobs), "the jobs did not spread over both stores"
            readers = [Reader(job["id"]) for job in jobs]
            reading = [asyncio.create_task(reader.read(client)) for reader in readers]
            await until(lambda: all(r.tokens() >= 10 for r in readers), "every reader gets tokens", 60)

            sentinels.processes[sentinels.primary_port].kill()
            # Meanwhile the first store takes new jobs and runs them.
            during = [(await submit(client, {**body, "prompt": f"Meanwhile {i}:"}))["id"] for i in range(2)]
            port = sentinels.sentinel_ports[0]
            sentinels.wait_until(
                lambda: sentinels.primary(port) == sentinels.replica_port, "the replica is promoted"
            )
            await asyncio.wait_for(asyncio.gather(*reading), 120)
            for job_id in during:
                assert (await wait_done(client, job_id))["status"] == "succeeded"
            for reader in readers:
                final = await wait_done(client, reader.job_id)
                assert final["status"] == "succeeded", final
                tokens = [event for event in reader.events if event.event == "token"]
                assert [event.data["index"] for event in tokens] == list(
                    itertools.accumulate((len(e.data["token_ids"]) for e in tokens[:-1]), initial=0)
                ), "a gap or a duplicate in the stream"
                assert "".join(event.data["text"] for event in tokens) == final["output"]
                assert reader.events[-1].event == "done"


async def idle(client: httpx.AsyncClient, model: str) -> None:
    """Until the model's workers report no job in flight (their heartbeats lag their jobs by up to one)."""
    async with asyncio.timeout(30):
        while True:
            overview = (await client.get("/v1/fleet")).json()
            if not sum(w["in_flight"] for w in overview["workers"] if w["model"] == model):
                return
            await asyncio.sleep(0.1)


def _store(name: str) -> Shard:
    return cast(Shard, SimpleNamespace(label=name, redis=SimpleNamespace(name=name)))


def _snapshot(model: str, states: list[tuple[Shard, tuple[int, ...]]]) -> FleetSnapshot:
    """A registry snapshot with, per store, (ready workers, capacity, in flight[, queued])."""
    by_store = {
        (id(store.redis), model): ModelState(model, 2048, ready, capacity, busy, ready=ready, queued=queued)
        for store, (ready, capacity, busy, queued) in (
            (store, (*figures, 0)[:4]) for store, figures in states
        )
    }
    return FleetSnapshot({model: 2048}, {}, by_store)


@pytest.mark.unit
def test_placement_fills_the_store_with_the_most_free_rows_and_keeps_an_idempotent_jobs_store() -> None:
    a, b, c = _store("a"), _store("b"), _store("c")
    placement = Placement()
    snapshot = _snapshot("m", [(a, (1, 8, 6)), (b, (1, 8, 2)), (c, (0, 0, 0))])
    assert placement.order([a, b, c], "m", snapshot, None) == [b, a]  # c has no ready worker: left out
    placement.moved(b, None, "m")
    # Each order counts a job on its first store, so that submissions awaiting Redis together spread;
    # it counts there until a snapshot read after its submission shows it.
    picks = [placement.order([a, b, c], "m", snapshot, None)[0] for _ in range(6)]
    assert [store.label for store in picks] == ["b", "b", "b", "b", "a", "b"]
    placement.moved(b, a, "m")  # the last went to a instead (b refused it): b has the more room now
    assert placement.order([a, b, c], "m", snapshot, None)[0] is b
    placement.moved(b, None, "m")  # no store took that one: b keeps its room
    assert placement.order([a, b, c], "m", snapshot, None)[0] is b
    # A new snapshot counts the workers' own figures again, their queues included, beside the jobs still
    # being submitted: b's 16 waiting jobs weigh more than a's full rows.
    fresh = _snapshot("m", [(a, (1, 8, 8)), (b, (1, 8, 0, 16)), (c, (0, 0, 0))])
    assert placement.order([a, b, c], "m", fresh, None) == [a, b]
    # An idempotency key gives one order, whatever the load, of the stores served (as for any job).
    keyed = placement.order([a, b, c], "m", snapshot, "ortfleet:idem:x")
    assert keyed == placement.order([a, b, c], "m", fresh, "ortfleet:idem:x")
    assert sorted(store.label for store in keyed) == ["a", "b"]
    on_c = next(f"ortfleet:idem:{n}" for n in range(100) if key_home([a, b, c], f"ortfleet:idem:{n}") is c)
    assert placement.order([a, b, c], "m", fresh, on_c, placing=False) == [a, b]  # its home is not served
    assert placement.order([a, b, c], "m", fresh, on_c, placing=False, keep_idle=True) == [c, a, b]
    assert placement.order([a], "m", snapshot, None) == [a]
    # A store nobody serves is left out while another is served, unless jobs may wait for workers.
    assert placement.order([c, a], "m", fresh, None, placing=False) == [a]
    assert placement.order([c, a], "m", fresh, None, placing=False, keep_idle=True) == [a, c]
    idle_only = _snapshot("m", [(c, (0, 0, 0))])
    assert placement.order([a, c], "m", idle_only, None, placing=False) == [a, c]
    # A tokenizer call asks the store with the most room, placing nothing there.
    looked = [placement.order([a, b, c], "m", fresh, None, placing=False)[0] for _ in range(3)]
    assert looked == [a, a, a]


@pytest.mark.unit
def test_placements_count_across_registry_snapshots_until_one_shows_them() -> None:
    """Submissions that each read a snapshot of their own still spread: a job being submitted counts on
    its store whatever the snapshot, and a submitted one until a snapshot read after it shows it."""
    a, b = _store("a"), _store("b")
    placement = Placement()
    idle = [(a, (1, 8, 0)), (b, (1, 8, 0))]
    picks = [placement.order([a, b], "m", _snapshot("m", idle), None)[0] for _ in range(4)]
    assert [store.label for store in picks] == ["a", "b", "a", "b"]
    before = _snapshot("m", idle)  # read while the four are being submitted
    for store in picks[:3]:
        placement.moved(store, store, "m")
    placement.moved(b, a, "m")  # the fourth went to a instead
    assert placement.order([a, b], "m", before, None, placing=False)[0] is b  # a: 3, b: 1
    # Read after them, a snapshot shows them (a's worker runs its 3, b's queue holds 1 and 3 of another
    # gateway's): each counts once.
    after = _snapshot("m", [(a, (1, 8, 3)), (b, (1, 8, 0, 4))])
    assert placement.order([a, b], "m", after, None, placing=False)[0] is a


@pytest.mark.unit
def test_a_keys_limits_are_shared_out_over_a_models_stores() -> None:
    assert share_of_limit(0, 3) == 0  # no limit
    assert share_of_limit(8, 1) == 8
    assert share_of_limit(8, 2) == 4
    assert share_of_limit(8, 3) == 3  # rounded up: the shares reach the whole limit
    assert share_of_limit(1, 3) == 1
    assert all(share_of_limit(limit, n) * n >= limit for limit in range(1, 40) for n in range(1, 6))
    assert all(share_of_limit(limit, n) * n < limit + n for limit in range(1, 40) for n in range(1, 6))


@pytest.mark.unit
def test_a_model_may_name_a_list_of_stores_each_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.settings import effective_settings

    shards: dict[str, Any] = {"big": ["redis://:pw@10.0.0.9:6379/0", "redis://10.0.0.10:6379/0"]}
    monkeypatch.setenv("ORTFLEET_REDIS_SHARDS", json.dumps(shards))
    settings = GatewaySettings()
    assert [store.url for store in settings.stores_for("big")] == shards["big"]
    assert effective_settings(settings)["redis_shards"] == {
        "big": ["redis://:****@10.0.0.9:6379/0", "redis://10.0.0.10:6379/0"]
    }
    for wrong, said in (
        (["redis://a:1/0", "redis://a:1/0"], "names one Redis twice"),
        ([], "empty list"),
        (["redis://a:1/0", "a:2"], r"the Redis of model 'big': .*scheme"),
    ):
        monkeypatch.setenv("ORTFLEET_REDIS_SHARDS", json.dumps({"big": wrong}))
        with pytest.raises(ValueError, match=said):
            GatewaySettings()
