"""What one API key keeps in files is capped, in bytes and in files, so that one key's uploads cannot fill
the Redis every key shares: past its cap a key's upload gets 400 file_quota_exceeded before its bytes
are stored, while another key still uploads; a file deleted, refused or expired stops counting."""

from __future__ import annotations

import asyncio
import secrets
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.conftest import Fleet, RedisServer, keys
from tests.test_security import bearer, create_key
from tests.waiting import until_seen

MOST_BYTES = 10_000
MOST_FILES = 3
QUOTA = {
    "ORTFLEET_KEY_MAX_STORED_FILE_BYTES": str(MOST_BYTES),
    "ORTFLEET_KEY_MAX_STORED_FILES": str(MOST_FILES),
}


@dataclass
class Tenants:
    url: str
    heavy: dict[str, str]  # the headers of the key that fills its quota
    light: dict[str, str]  # another key's
    heavy_name: str


def start_tenants(fleet: Fleet, key_file: Path, env: dict[str, str]) -> Tenants:
    suffix = secrets.token_hex(4)
    heavy, light = create_key(key_file, f"heavy-{suffix}"), create_key(key_file, f"light-{suffix}")
    _, url = fleet.start_gateway(env={"ORTFLEET_API_KEYS_FILE": str(key_file), **QUOTA, **env})
    return Tenants(url, bearer(heavy), bearer(light), f"heavy-{suffix}")


@pytest.fixture
def gateway_of(
    redis_server: RedisServer, tiny_model: Path, tmp_path: Path
) -> Iterator[Callable[[dict[str, str]], Tenants]]:
    """Starts a gateway with two keys, a file quota of MOST_BYTES and MOST_FILES, and the settings given."""
    fleet = Fleet(redis_server.url, tiny_model)
    yield lambda env: start_tenants(fleet, tmp_path / "keys.json", env)
    fleet.stop_all()


@pytest.fixture
def tenants(gateway_of: Callable[[dict[str, str]], Tenants]) -> Tenants:
    return gateway_of({})


def jsonl(size: int) -> bytes:
    line = b'{"custom_id": "x", "pad": "' + b"x" * 60 + b'"}\n'
    return (line * (size // len(line) + 1))[:size]


async def upload(client: httpx.AsyncClient, headers: dict[str, str], size: int) -> httpx.Response:
    files = {"file": ("in.jsonl", jsonl(size))}
    return await client.post("/v1/files", files=files, data={"purpose": "batch"}, headers=headers)


async def kept(redis: Redis, owner: str) -> tuple[int, int]:
    """The bytes and files the gateway counts for the key, as Redis holds them."""
    counted = keys.file_quota(owner)
    return int(await redis.get(counted.total) or 0), int(await redis.hlen(counted.sizes))  # type: ignore[misc]


def assert_over_quota(reply: httpx.Response, setting: str, most: int) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "file_quota_exceeded",
        "file",
        "invalid_request_error",
    )
    assert setting in error["message"] and str(most) in error["message"], error


async def test_a_key_past_its_bytes_of_files_gets_400_file_quota_exceeded_and_another_key_still_uploads(
    tenants: Tenants,
) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, timeout=10) as client:
        first = await upload(client, tenants.heavy, 4000)
        second = await upload(client, tenants.heavy, 4000)
        past = await upload(client, tenants.heavy, 4000)
        other = await upload(client, tenants.light, 4000)
        listed = await client.get("/v1/files", headers=tenants.heavy)
    assert (first.status_code, second.status_code, other.status_code) == (200, 200, 200), other.text
    assert_over_quota(past, "ORTFLEET_KEY_MAX_STORED_FILE_BYTES", MOST_BYTES)
    assert {f["id"] for f in listed.json()["data"]} == {second.json()["id"], first.json()["id"]}


async def test_a_key_at_its_most_files_gets_400_file_quota_exceeded_naming_the_file_limit(
    tenants: Tenants, redis: Redis
) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, timeout=10) as client:
        made = [await upload(client, tenants.heavy, 100) for _ in range(MOST_FILES)]
        past = await upload(client, tenants.heavy, 100)
        other = await upload(client, tenants.light, 100)
    assert [reply.status_code for reply in made] == [200] * MOST_FILES
    assert_over_quota(past, "ORTFLEET_KEY_MAX_STORED_FILES", MOST_FILES)
    assert other.status_code == 200, other.text
    assert await kept(redis, tenants.heavy_name) == (100 * MOST_FILES, MOST_FILES)


async def test_an_upload_past_the_quota_is_refused_from_its_content_length_before_its_body_is_read(
    tenants: Tenants,
) -> None:
    url = urllib.parse.urlsplit(tenants.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    head = (
        "POST /v1/files HTTP/1.1\r\nHost: gateway\r\n"
        f"Authorization: {tenants.heavy['Authorization']}\r\n"
        "Content-Type: multipart/form-data; boundary=b\r\n"
        f"Content-Length: {MOST_BYTES + 1}\r\n\r\n"
    )
    writer.write(head.encode())  # and never a byte of the body
    await writer.drain()
    try:
        status = await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()
    assert status.startswith(b"HTTP/1.1 400"), status


async def test_files_deleted_or_refused_stop_counting_and_the_key_uploads_again(
    tenants: Tenants, redis: Redis
) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, timeout=10) as client:
        for _ in range(5):  # filled and emptied again and again: the count never drifts
            made = [await upload(client, tenants.heavy, 3000) for _ in range(MOST_FILES)]
            assert [reply.status_code for reply in made] == [200] * MOST_FILES, made[-1].text
            assert await kept(redis, tenants.heavy_name) == (3000 * MOST_FILES, MOST_FILES)
            refused = await client.post(
                "/v1/files",
                files={"file": ("x.jsonl", b"{}\n")},
                data={"purpose": "fine-tune"},
                headers=tenants.heavy,
            )
            assert refused.status_code == 400, refused.text
            assert await kept(redis, tenants.heavy_name) == (3000 * MOST_FILES, MOST_FILES)
            for reply in made:
                deleted = await client.delete(f"/v1/files/{reply.json()['id']}", headers=tenants.heavy)
                assert deleted.status_code == 200, deleted.text
            assert await kept(redis, tenants.heavy_name) == (0, 0)


async def test_files_that_expire_stop_counting_and_the_key_uploads_again(
    gateway_of: Callable[[dict[str, str]], Tenants], redis: Redis
) -> None:
    tenants = gateway_of({"ORTFLEET_FILE_TTL_S": "2"})
    async with httpx.AsyncClient(base_url=tenants.url, timeout=10) as client:
        made = [await upload(client, tenants.heavy, 3000) for _ in range(MOST_FILES)]
        past = await upload(client, tenants.heavy, 100)

        async def expired() -> bool:
            return not await redis.exists(*(keys.file(reply.json()["id"]) for reply in made))

        await until_seen(expired, "the files expired", timeout_s=10)
        again = [await upload(client, tenants.heavy, 3000) for _ in range(MOST_FILES)]
        counted = await kept(redis, tenants.heavy_name)  # within the new files' two seconds
    assert [reply.status_code for reply in made + again] == [200] * MOST_FILES * 2, again[-1].text
    assert_over_quota(past, "ORTFLEET_KEY_MAX_STORED_FILES", MOST_FILES)
    assert counted == (3000 * MOST_FILES, MOST_FILES)
