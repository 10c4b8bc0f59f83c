"""A fleet on a Redis Cluster (3 primaries, 3 replicas): a model's stores are hash tags spread over the
primaries, every route and job script runs there, and a primary killed or a store's slot moved under load
loses no accepted job and leaves no gap in any stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from redis.crc import key_slot

from common.keys import HOME_TAG, Keyspace, store_tag
from ortfleet.fleet.processes import stop
from tests.conftest import LOGS, Fleet
from tests.jobs_client import read_events, streamed_text, submit, wait_done
from tests.redis_cluster import RedisCluster
from tests.sentinel_group import Reader
from tests.test_cli import ortfleet
from tests.waiting import until

MODEL = "tiny-cluster"
STORES = 3


@dataclass
class ClusterFleet:
    cluster: RedisCluster
    fleet: Fleet

    @property
    def url(self) -> str:
        return self.fleet.gateway_url

    def store_keys(self, model: str = MODEL) -> list[Keyspace]:
        return [Keyspace(store_tag(model, i, STORES)) for i in range(STORES)]

    def port_of(self, keys: Keyspace) -> int:
        """The port of the primary that serves the keyspace's slot now."""
        return self.cluster.node_of_slot(key_slot((keys.tag or "").encode()))

    def jobs_on(self, keys: Keyspace) -> set[str]:
        """The ids of the jobs whose records the keyspace holds, read from the primary serving it."""
        with self.cluster.client(self.port_of(keys)) as node:
            found = node.scan_iter(match=keys.job("*"), count=1000)
            return {str(key).removeprefix(keys.job("")) for key in found}


def start_cluster_fleet(directory: Path, model_dir: Path, env: dict[str, str] | None = None) -> ClusterFleet:
    cluster = RedisCluster(directory, LOGS)
    cluster.start()
    shards = json.dumps({MODEL: STORES})
    fleet = Fleet(cluster.url, model_dir, env={"ORTFLEET_REDIS_SHARDS": shards, **(env or {})})
    return ClusterFleet(cluster, fleet)


@pytest.fixture(scope="module")
def on_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ClusterFleet]:
    """A gateway and one tiny-model worker on each of the model's three stores, on a cluster of their own."""
    # each step 10 ms longer: a long job is still running when it is cancelled
    setup = start_cluster_fleet(
        tmp_path_factory.mktemp("cluster"), tiny_model, {"ORTFLEET_STEP_DELAY_S": "0.01"}
    )
    try:
        setup.fleet.start_gateway()
        for store in range(1, STORES + 1):
            setup.fleet.start_worker(MODEL, env={"ORTFLEET_STORE": str(store)})
        setup.fleet.wait_workers(MODEL, STORES)
        yield setup
    finally:
        setup.fleet.stop_all()
        setup.cluster.stop_all()


def assert_whole_stream(events: list[Any], final: dict[str, Any]) -> None:
    """Token events numbered 0, 1, ... without a gap or a repeat, adding up to the job's output."""
    tokens = [event for event in events if event.event == "token"]
    ids: list[int] = []
    for event in tokens:
        assert event.data["index"] == len(ids), (event, len(ids))
        ids += event.data["token_ids"]
    assert len(ids) == final["usage"]["completion_tokens"], final
    assert "".join(event.data["text"] for event in tokens) == final["output"]
    assert events[-1].event == "done", events[-1]


async def test_a_models_jobs_spread_over_every_primary_and_stream_whole(on_cluster: ClusterFleet) -> None:
    stores = on_cluster.store_keys()
    assert len({on_cluster.port_of(keys) for keys in stores}) == STORES  # one store a primary
    async with httpx.AsyncClient(base_url=on_cluster.url, timeout=60) as client:
        jobs = await asyncio.gather(
            *(submit(client, {"model": MODEL, "prompt": f"Tale {i}:", "max_tokens": 12}) for i in range(24))
        )
        streams = await asyncio.gather(*(read_events(client, job["id"]) for job in jobs))
        finals = [await wait_done(client, job["id"]) for job in jobs]
        fleet_view = (await client.get("/v1/fleet")).json()

    for events, final in zip(streams, finals, strict=True):
        assert final["status"] == "succeeded", final
        assert streamed_text(events) == final["output"]
        assert_whole_stream(events, final)
    placed = [on_cluster.jobs_on(keys) for keys in stores]
    ids = {job["id"] for job in jobs}
    assert set().union(*placed) >= ids
    assert all(ids & jobs_here for jobs_here in placed), [len(ids & here) for here in placed]
    nodes = [store["node"] for store in fleet_view["stores"]]  # the home store's, then the model's three
    assert len(nodes) == STORES + 1 and all(nodes), fleet_view["stores"]
    assert len(set(nodes[1:])) == STORES  # a primary each: named by node id, not by address
    assert "127.0.0.1:" not in json.dumps(fleet_view)  # no node named by its address
    [model] = [m for m in fleet_view["models"] if m["id"] == MODEL]
    assert model["workers"] == STORES and model["ready_workers"] == STORES
    # `ortfleet status` reads every store on the cluster, and names the node of each
    shown = ortfleet(
        "status", "--json", env={"ORTFLEET_REDIS_URL": on_cluster.cluster.url, **on_cluster.fleet.env}
    )
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    [row] = [m for m in status["models"] if m["name"] == MODEL]
    assert row["workers"] == STORES and row["finished_last_minute"] >= len(jobs)
    assert [store["node"] for store in status["stores"]] == nodes  # as the gateway sees them


async def test_openai_calls_cancel_and_idempotency_on_the_cluster(on_cluster: ClusterFleet) -> None:
    async with openai.AsyncOpenAI(base_url=on_cluster.url + "/v1", api_key="unused", max_retries=0) as sdk:
        chat = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            logprobs=True,
            top_logprobs=2,
        )
        logprobs = chat.choices[0].logprobs
        assert chat.usage is not None and chat.usage.completion_tokens > 0, chat
        assert logprobs is not None and len(logprobs.content or []) == chat.usage.completion_tokens
        # A streamed completion: its chunks arrive through the relay of the job's store. The tiny random
        # model may sample its end as its first token: ignore_eos keeps the stream from ending at once.
        pieces = [
            chunk.choices[0].text
            async for chunk in await sdk.completions.create(
                model=MODEL, prompt="Once", max_tokens=8, stream=True, extra_body={"ignore_eos": True}
            )
            if chunk.choices
        ]
        assert len(pieces) > 1
    async with httpx.AsyncClient(base_url=on_cluster.url, timeout=60) as client:
        tokens = await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"})
        assert tokens.status_code == 200 and tokens.json()["count"] > 0, tokens.text
        body = {"model": MODEL, "prompt": "Again:", "max_tokens": 6}
        first = await submit(client, body, **{"Idempotency-Key": "cluster-retry"})
        retried = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "cluster-retry"})
        assert retried.json()["id"] == first["id"]
        long = await submit(
            client, {"model": MODEL, "prompt": "Long:", "max_tokens": 400, "ignore_eos": True}
        )
        cancelled = await client.delete(f"/v1/jobs/{long['id']}")
        assert cancelled.status_code in (200, 202), cancelled.text
        assert (await wait_done(client, long["id"]))["status"] == "cancelled"
        listed = (await client.get("/v1/jobs", params={"limit": 100})).json()
        assert {first["id"], long["id"]} <= {job["id"] for job in listed["data"]}
        assert listed["unreachable_stores"] == []


async def test_files_batches_and_responses_live_under_the_home_tag(on_cluster: ClusterFleet) -> None:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"Line {i}", "max_tokens": 4}}
        for i in range(4)
    ]  # fmt: skip
    async with openai.AsyncOpenAI(base_url=on_cluster.url + "/v1", api_key="unused", max_retries=0) as sdk:
        upload = await sdk.files.create(
            file=("in.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()), purpose="batch"
        )
        batch = await sdk.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 120
        while (batch := await sdk.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, batch
            await asyncio.sleep(0.2)
        assert batch.status == "completed" and batch.output_file_id, batch
        output = await sdk.files.content(batch.output_file_id)
        answers = [json.loads(line) for line in output.text.splitlines()]
        assert sorted(answer["custom_id"] for answer in answers) == [f"r{i}" for i in range(4)]
        response = await sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=6)
        assert (await sdk.responses.retrieve(response.id)).id == response.id

    home = Keyspace(HOME_TAG)
    port = on_cluster.cluster.node_of_slot(key_slot(HOME_TAG.encode()))
    with on_cluster.cluster.client(port) as node:
        assert node.exists(home.file(upload.id), home.batch(batch.id), home.response(response.id)) == 3


async def test_key_limits_purges_file_quotas_and_queue_deadlines_run_on_the_cluster(
    on_cluster: ClusterFleet, tiny_model: Path
) -> None:
    """The scripts the routes above leave out: a key's request rate and tokenize budget, a purge, a file's
    quota held and released, and a queued job expired at its deadline (by the gateway's sweep)."""
    gone = f"{MODEL}-gone"  # known to the fleet (registered once), served by nobody now: its jobs wait
    env = {
        "ORTFLEET_API_KEYS": "alice:key-alice-0123456789",
        "ORTFLEET_KEY_REQUESTS_PER_MINUTE": "600",
        "ORTFLEET_KEY_TOKENIZE_CHARS_PER_S": "1",
        "ORTFLEET_QUEUE_WITHOUT_WORKERS": "true",
        "ORTFLEET_QUEUE_TIMEOUT_S": "1",
    }
    keyed = Fleet(
        on_cluster.cluster.url, tiny_model, env={"ORTFLEET_REDIS_SHARDS": json.dumps({MODEL: STORES})}
    )
    try:
        stop(keyed.start_worker(gone).process)
        _, url = keyed.start_gateway(env)
        headers = {"Authorization": "Bearer key-alice-0123456789"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
            done = await submit(client, {"model": MODEL, "prompt": "Hi", "max_tokens": 4})
            assert (await wait_done(client, done["id"]))["status"] == "succeeded"
            purged = await client.delete(f"/v1/jobs/{done['id']}", params={"purge": "true"})
            assert purged.status_code == 204, purged.text
            assert (await client.get(f"/v1/jobs/{done['id']}")).status_code == 404
            tokens = await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello " * 100})
            assert tokens.status_code == 200, tokens.text  # a full budget takes any one call
            again = await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello"})
            assert again.status_code == 429 and again.json()["error"]["code"] == "tokenize_rate_exceeded"
            upload = await client.post(
                "/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b'{"custom_id": "1"}\n')}
            )
            assert upload.status_code == 200, upload.text
            assert (await client.delete(f"/v1/files/{upload.json()['id']}")).status_code == 200
            waiting = await submit(client, {"model": gone, "prompt": "Hi", "max_tokens": 4})
            expired = await wait_done(client, waiting["id"])
    finally:
        keyed.stop_all()

    assert expired["status"] == "failed" and expired["error_code"] == "expired_in_queue", expired
    home = Keyspace(HOME_TAG)
    with on_cluster.cluster.client(on_cluster.cluster.node_of_slot(key_slot(HOME_TAG.encode()))) as node:
        assert node.zcard(home.request_rate("alice")) >= 5  # each keyed request counted
        assert node.exists(home.tokenize_budget("alice"))  # 600 characters at one a second: still spent
        assert int(node.get(home.file_quota("alice").total) or 0) == 0  # held, then released


def tokens_read(readers: list[Reader]) -> int:
    return sum(reader.tokens() for reader in readers)


async def streams_through(
    directory: Path,
    model_dir: Path,
    env: dict[str, str],
    disturb: Callable[[ClusterFleet, list[Reader]], Awaitable[None]],
    max_tokens: int = 120,
) -> None:
    """Nine jobs stream from the model's three stores while `disturb` acts on the cluster, and six more are
    submitted after it: every job succeeds, and every stream is whole."""
    setup = start_cluster_fleet(directory, model_dir, {"ORTFLEET_STEP_DELAY_S": "0.02", **env})
    try:
        setup.fleet.start_gateway()
        for store in range(1, STORES + 1):
            setup.fleet.start_worker(MODEL, env={"ORTFLEET_STORE": str(store)})
        setup.fleet.wait_workers(MODEL, STORES)
        async with httpx.AsyncClient(base_url=setup.url, timeout=120) as client:
            body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True}
            jobs = [await submit(client, {**body, "prompt": f"Story {i}:"}) for i in range(9)]
            readers = [Reader(job["id"]) for job in jobs]
            reading = [asyncio.create_task(reader.read(client)) for reader in readers]
            await until(lambda: all(r.tokens() >= 5 for r in readers), "every reader gets tokens", 60)
            await disturb(setup, readers)
            after = [
                await submit(client, {**body, "prompt": f"After {i}:", "max_tokens": 20}) for i in range(6)
            ]
            await asyncio.wait_for(asyncio.gather(*reading), 180)
            finals = [await wait_done(client, job["id"], timeout_s=60) for job in jobs + after]
    finally:
        setup.fleet.stop_all()
        setup.cluster.stop_all()

    assert all(final["status"] == "succeeded" for final in finals), [f["status"] for f in finals]
    for reader, final in zip(readers, finals, strict=False):
        assert_whole_stream(reader.events, final)


async def test_a_primary_killed_mid_load_loses_no_accepted_job_and_no_stream_has_a_gap(
    tmp_path: Path, tiny_model: Path
) -> None:
    async def kill_a_primary(setup: ClusterFleet, _readers: list[Reader]) -> None:
        # a primary other than the node the fleet was given (ORTFLEET_REDIS_URL), which stays a seed
        ports = [setup.port_of(keys) for keys in setup.store_keys()]
        victim = next(port for port in ports if port != setup.cluster.ports[0])
        setup.cluster.kill(victim)
        setup.cluster.wait_failover(victim)
        setup.cluster.restart(victim)  # back as its successor's replica: submissions are confirmed again
        setup.cluster.wait_until(setup.cluster.healthy, "the old primary replicates its successor")

    env = {
        "ORTFLEET_SUBMIT_REPLICAS": "1",
        "ORTFLEET_HEARTBEAT_TTL_S": "15",  # the failover takes seconds: the workers keep their jobs
    }
    await streams_through(tmp_path, tiny_model, env, kill_a_primary)


async def test_a_stores_slot_moved_to_another_primary_mid_load_loses_nothing(
    tmp_path: Path, tiny_model: Path
) -> None:
    async def move_a_slot(setup: ClusterFleet, readers: list[Reader]) -> None:
        moved = setup.store_keys()[0]
        slot = key_slot((moved.tag or "").encode())
        source = setup.port_of(moved)
        target = next(port for port in setup.cluster.primary_ports() if port != source)
        migration = setup.cluster.begin_migration(slot, target)
        migration.move_keys(limit=20)  # half-way: some of the store's keys moved, the rest not yet
        read = tokens_read(readers)  # the jobs stream on while the slot is split between two primaries
        await until(lambda: tokens_read(readers) >= read + 30, "tokens stream during the move", 60)
        migration.finish()
        assert setup.port_of(moved) == target

    await streams_through(tmp_path, tiny_model, {}, move_a_slot)


async def test_a_worker_stopped_mid_stream_hands_its_jobs_back_and_another_resumes_them(
    tmp_path: Path, tiny_model: Path
) -> None:
    async def replace_a_worker(setup: ClusterFleet, _readers: list[Reader]) -> None:
        first = setup.fleet.workers[0]  # store 1's
        setup.fleet.start_worker(MODEL, env={"ORTFLEET_STORE": "1"})
        stop(first.process)  # no shutdown grace in the tests: its running jobs go back to the queue
        assert any("handed back to the queue" in line for line in first.last_lines()), first.last_lines()

    await streams_through(tmp_path, tiny_model, {}, replace_a_worker, max_tokens=300)
