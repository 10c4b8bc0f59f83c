"""A full Redis (maxmemory reached, noeviction) is named: submissions and writes get 503 store_full
naming memory, /readyz gives memory as its reason (not "no live worker"), a worker says so once a
period rather than at every retry, and every job finishes once Redis has room again."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from common.store_watch import OUT_OF_MEMORY
from ortfleet.fleet.launcher import FleetProcess
from tests.conftest import Fleet, RedisServer
from tests.jobs_client import read_events, submit
from tests.test_reliability import assert_contiguous
from tests.test_security import bearer, create_key

TOKENS = 40


@pytest.fixture
def own_fleet_with_worker(own_redis: RedisServer, tiny_model: Path, model_name: str) -> Iterator[Fleet]:
    fleet = Fleet(own_redis.url, tiny_model)
    fleet.start_gateway()
    fleet.start_worker(model_name, "--fake-engine", "100:2")  # a token every 100 ms
    yield fleet
    fleet.stop_all()


async def readyz_says(client: httpx.AsyncClient, what: str, timeout_s: float = 10) -> httpx.Response:
    """The first /readyz answer whose reason holds `what` (or that is ready, for `what` "ready")."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = await client.get("/readyz")
        body = reply.json()
        if (what == "ready" and body["status"] == "ready") or what in body.get("reason", ""):
            return reply
        assert time.monotonic() < deadline, f"/readyz said {body} after {timeout_s:g} s"
        await asyncio.sleep(0.1)


async def heartbeat_lapsed(redis: Redis, timeout_s: float = 20) -> None:
    """Until no worker's registry entry is live: its heartbeats have failed for a whole TTL."""
    deadline = time.monotonic() + timeout_s
    while await redis.zrangebyscore("ortfleet:workers", int(time.time() * 1000), "+inf"):
        assert time.monotonic() < deadline, f"a worker still live after {timeout_s:g} s"
        await asyncio.sleep(0.1)


def out_of_memory_lines(worker: FleetProcess) -> list[str]:
    assert worker.log is not None
    return [line for line in worker.log.read_text().splitlines() if OUT_OF_MEMORY in line]


async def test_a_full_redis_is_named_in_errors_readyz_and_once_in_the_workers_log(
    own_fleet_with_worker: Fleet, own_redis_client: Redis, model_name: str
) -> None:
    fleet = own_fleet_with_worker
    job_body = {"model": model_name, "prompt": "Hi", "max_tokens": TOKENS}
    async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as client:
        running = await submit(client, job_body)
        connected = asyncio.Event()
        stream = asyncio.create_task(read_events(client, running["id"], connected=connected))
        await connected.wait()

        await own_redis_client.config_set("maxmemory", "1")  # full, whatever it holds
        ready = await readyz_says(client, "out of memory")
        refused = await client.post("/v1/jobs", json=job_body)
        upload = await client.post(
            "/v1/files", files={"file": ("in.jsonl", b'{"a": 1}\n')}, data={"purpose": "batch"}
        )
        await heartbeat_lapsed(own_redis_client)
        said = out_of_memory_lines(fleet.workers[0])
        still = await client.get("/readyz")

        await own_redis_client.config_set("maxmemory", "0")
        await readyz_says(client, "ready")
        events = await asyncio.wait_for(stream, 30)
        after = await client.post("/v1/jobs", json=job_body)

    assert ready.status_code == 503 and "maxmemory" in ready.json()["reason"], ready.json()
    assert "no live worker" not in still.json()["reason"], still.json()
    for reply in (refused, upload):
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "store_full"
        assert "memory" in reply.json()["error"]["message"]
        assert reply.headers["Retry-After"]
    assert len(said) == 1, said  # many writes and heartbeats failed meanwhile
    assert events[-1].event == "done", events[-1]
    # no gap, no duplicate (the tokens that waited while Redis was full go out together, as one event)
    assert len(assert_contiguous(events)) == TOKENS
    assert after.status_code == 202, after.text


MAXMEMORY = 8 * 2**20


@contextlib.asynccontextmanager
async def two_keys_on_a_small_redis(
    own_redis: RedisServer,
    own_redis_client: Redis,
    tiny_model: Path,
    model_name: str,
    tmp_path: Path,
    env: dict[str, str] | None = None,
) -> AsyncIterator[tuple[Fleet, dict[str, str], dict[str, str]]]:
    """A gateway with two API keys (heavy, light: their headers) and a fake-engine worker, on a Redis of
    MAXMEMORY bytes."""
    key_file, suffix = tmp_path / "keys.json", secrets.token_hex(4)
    heavy = bearer(create_key(key_file, f"heavy-{suffix}"))
    light = bearer(create_key(key_file, f"light-{suffix}"))
    fleet = Fleet(own_redis.url, tiny_model, env={"ORTFLEET_API_KEYS_FILE": str(key_file), **(env or {})})
    try:
        fleet.start_gateway()
        fleet.start_worker(model_name, "--fake-engine", "1:1")
        await own_redis_client.config_set("maxmemory", str(MAXMEMORY))
        yield fleet, heavy, light
    finally:
        fleet.stop_all()


async def fill_with_files(
    client: httpx.AsyncClient, headers: dict[str, str], size: int, refused_with: str = "store_full"
) -> list[str]:
    """Uploads files of `size` bytes until one is refused with `refused_with`; the ids of those taken."""
    taken: list[str] = []
    line = b'{"custom_id": "x", "pad": "' + b"x" * 200 + b'"}\n'
    content = (line * (size // len(line) + 1))[:size]
    for _ in range(4 * MAXMEMORY // size):
        files = {"file": ("in.jsonl", content)}
        reply = await client.post("/v1/files", files=files, data={"purpose": "batch"}, headers=headers)
        if reply.status_code != 200:
            assert reply.json()["error"]["code"] == refused_with, reply.text
            return taken
        taken.append(reply.json()["id"])
    raise AssertionError(f"Redis took {len(taken)} files of {size} bytes without filling")


async def test_a_redis_filled_by_one_keys_files_answers_every_caller_store_full_until_it_has_room(
    own_redis: RedisServer, own_redis_client: Redis, tiny_model: Path, model_name: str, tmp_path: Path
) -> None:
    env = {
        "ORTFLEET_HEARTBEAT_TTL_S": "1",
        "ORTFLEET_FILES_MAX_MEMORY_SHARE": "1",  # files may fill it: what every caller gets then
    }
    async with two_keys_on_a_small_redis(
        own_redis, own_redis_client, tiny_model, model_name, tmp_path, env
    ) as (
        fleet,
        heavy,
        light,
    ):
        chat = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=10) as client:
            taken = await fill_with_files(client, heavy, 2**20)
            taken += await fill_with_files(client, heavy, 1024)  # a trickle, up to the last kilobyte
            at_the_brim = [
                await client.post("/v1/chat/completions", json=chat, headers=light),
                await client.get("/readyz"),
            ]
            used = int((await own_redis_client.info("memory"))["used_memory"])
            # past it, by more than the clients' buffers the uploads leave may free: heartbeats are refused
            await own_redis_client.config_set("maxmemory", str(used - 2**20))
            await heartbeat_lapsed(own_redis_client, timeout_s=10)  # the worker looks dead
            chats = [await client.post("/v1/chat/completions", json=chat, headers=light) for _ in range(6)]
            job = await client.post("/v1/jobs", json={"model": model_name, "prompt": "Hi"}, headers=light)
            unnamed = await client.post("/v1/jobs", json={"prompt": "Hi"}, headers=light)
            ready = await client.get("/readyz")

            await own_redis_client.config_set("maxmemory", str(MAXMEMORY))
            for file_id in taken:  # the key frees what it filled
                deleted = await client.delete(f"/v1/files/{file_id}", headers=heavy)
                assert deleted.status_code == 200, deleted.text
            await readyz_says(client, "ready")
            after = await client.post("/v1/chat/completions", json=chat, headers=light)
    for reply in [at_the_brim[0], *chats, job, unnamed]:
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "store_full", reply.text
        assert reply.headers["Retry-After"]
    for readiness in (at_the_brim[1], ready):
        reason = readiness.json().get("reason", "")
        assert readiness.status_code == 503, readiness.json()
        assert "store 1" in reason and "out of memory" in reason, readiness.json()
        assert str(own_redis.port) not in reason, reason  # a caller learns how the store fares, not where
    assert after.status_code == 200, after.text


async def test_files_fill_their_redis_only_to_their_share_and_another_keys_chats_go_on(
    own_redis: RedisServer, own_redis_client: Redis, tiny_model: Path, model_name: str, tmp_path: Path
) -> None:
    """By default files may fill their Redis to half its maxmemory, whoever uploads them: one key's
    uploads are refused there with 400 file_quota_exceeded, the Redis never fills, and another key's
    chats and the gateway's readiness go on."""
    async with two_keys_on_a_small_redis(own_redis, own_redis_client, tiny_model, model_name, tmp_path) as (
        fleet,
        heavy,
        light,
    ):
        chat = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=10) as client:
            taken = await fill_with_files(client, heavy, 2**18, refused_with="file_quota_exceeded")
            # Redis's memory falls back once the refused upload's lines are deleted and its idle clients'
            # query buffers are freed, so an upload only just past the share may fit a moment later; one
            # of a MiB cannot, since the files taken hold most of the share.
            refused = await client.post(
                "/v1/files",
                files={"file": ("in.jsonl", b'{"a": 1}\n' * (2**20 // 9))},
                data={"purpose": "batch"},
                headers=heavy,
            )
            used = int((await own_redis_client.info("memory"))["used_memory"])
            chats = [await client.post("/v1/chat/completions", json=chat, headers=light) for _ in range(3)]
            ready = await client.get("/readyz")
    assert taken, "no file was taken before the share was reached"
    assert used <= MAXMEMORY // 2 + 2**18, used  # the share held, within one file
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "file_quota_exceeded"
    assert "ORTFLEET_FILES_MAX_MEMORY_SHARE" in refused.json()["error"]["message"]
    assert all(reply.status_code == 200 for reply in chats), [reply.text for reply in chats]
    assert ready.status_code == 200, ready.json()
