"""OpenAI's Files API with the official `openai` SDK: uploads read as a stream into Redis, capped in size."""

from __future__ import annotations

import io
import secrets
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from redis.asyncio import Redis

from gateway.batches.state import BatchState, new_batch_id
from gateway.files.store import FileInUse, FileStore, new_file_id
from tests.conftest import Fleet, RedisServer, keys

MAX_FILE = 300_000
MAX_BODY = 4096


# The client tests' gateway (`client`, on `fleet`) is the module's, started once for all of them.
pytestmark = pytest.mark.module_fleet


@pytest.fixture(scope="module")
def capped_gateway(redis_server: RedisServer, tiny_model: Path) -> Iterator[str]:
    """A gateway whose files may be far larger than its request bodies, one for the module's tests; yields
    its URL."""
    env = {"ORTFLEET_MAX_FILE_BYTES": str(MAX_FILE), "ORTFLEET_MAX_BODY_BYTES": str(MAX_BODY)}
    fleet = Fleet(redis_server.url, tiny_model, env=env)
    try:
        fleet.start_gateway()
        yield fleet.gateway_url
    finally:
        fleet.stop_all()


@pytest.fixture
def sdk(capped_gateway: str) -> Iterator[openai.OpenAI]:
    """The official openai SDK pointed at the module's capped gateway."""
    with openai.OpenAI(base_url=capped_gateway + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def jsonl(lines: int, width: int = 100) -> bytes:
    return b"".join(b'{"custom_id": "%d", "pad": "%s"}\n' % (i, b"x" * width) for i in range(lines))


def test_an_uploaded_file_is_listed_read_back_byte_for_byte_and_deleted(sdk: openai.OpenAI) -> None:
    content = jsonl(2000)  # larger than a request body may be: the upload is read as a stream
    assert MAX_BODY < len(content) < MAX_FILE
    uploaded = sdk.files.create(file=("requests.jsonl", io.BytesIO(content)), purpose="batch")
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (len(content), "requests.jsonl", "batch")
    assert sdk.files.retrieve(uploaded.id).bytes == len(content)
    assert uploaded.id in [f.id for f in sdk.files.list()]
    assert sdk.files.content(uploaded.id).content == content
    assert sdk.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(uploaded.id)


def test_a_file_past_the_size_cap_is_refused_with_413(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        sdk.files.create(file=("big.jsonl", io.BytesIO(jsonl(4000))), purpose="batch")
    assert refused.value.status_code == 413


def test_a_line_longer_than_a_request_body_is_refused_naming_it(sdk: openai.OpenAI) -> None:
    content = jsonl(3) + jsonl(1, width=MAX_BODY * 2)
    with pytest.raises(openai.APIStatusError, match="line 4") as refused:
        sdk.files.create(file=("long.jsonl", io.BytesIO(content)), purpose="batch")
    assert refused.value.status_code == 413


def test_a_purpose_other_than_batch_is_refused_naming_it(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose"):
        sdk.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")


@pytest.mark.parametrize("route", ["/v1/files", "/v1/batches", "/v1/jobs"])
@pytest.mark.parametrize("limit", ["²", "٣", "0", "1000000000000", "-1", "x"])
async def test_a_list_limit_that_is_not_a_whole_number_in_range_is_refused_naming_it(
    client: httpx.AsyncClient, route: str, limit: str
) -> None:
    reply = await client.get(route, params={"limit": limit})
    assert reply.status_code in (400, 422), reply.text
    assert reply.json()["error"]["param"] == "limit"


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"garbage",
        b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n',  # no closing boundary
        b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\n',
    ],
    ids=["empty", "garbage", "truncated-field", "truncated-file"],
)
async def test_a_body_that_is_not_valid_multipart_is_refused_saying_so(
    client: httpx.AsyncClient, body: bytes
) -> None:
    before = (await client.get("/v1/files")).json()["data"]
    reply = await client.post(
        "/v1/files", content=body, headers={"content-type": "multipart/form-data; boundary=B"}
    )
    assert reply.status_code == 400, reply.text
    assert "not valid multipart/form-data" in reply.json()["error"]["message"], reply.text
    assert (await client.get("/v1/files")).json()["data"] == before


@pytest.mark.parametrize("filename", ["données-日本.jsonl", "emoji-😀.jsonl", "semi;colon back\\slash.jsonl"])
async def test_a_file_named_in_any_script_downloads_with_its_name_in_rfc_5987_form(
    client: httpx.AsyncClient, filename: str
) -> None:
    files = {"file": (filename, b'{"a": 1}\n'), "purpose": (None, b"batch")}
    uploaded = (await client.post("/v1/files", files=files)).json()
    assert uploaded["filename"] == filename
    for _ in range(2):  # the connection stays usable after the download
        content = await client.get(f"/v1/files/{uploaded['id']}/content")
        assert content.status_code == 200 and content.content == b'{"a": 1}\n'
        disposition = content.headers["content-disposition"]
        assert disposition.isascii() and "filename*=UTF-8''" in disposition
        encoded = disposition.split("filename*=UTF-8''")[1].split(";")[0]
        assert urllib.parse.unquote(encoded) == filename


@pytest.mark.parametrize("filename", ["a\x00b.jsonl", "line\nbreak.jsonl", "tab\there.jsonl"])
async def test_a_filename_with_a_control_character_is_refused_naming_file(
    client: httpx.AsyncClient, filename: str
) -> None:
    boundary = "B"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n\r\n'
        '{"a": 1}\n\r\n'
        f"--{boundary}--\r\n"
    ).encode()
    for _ in range(2):  # answered, on a connection that stays usable
        reply = await client.post(
            "/v1/files", content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}"}
        )
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "file"


async def test_paging_through_files_made_in_the_same_second_lists_each_once(
    client: httpx.AsyncClient,
) -> None:
    made = set()
    for i in range(7):
        files = {"file": (f"{i}.jsonl", b"{}\n"), "purpose": (None, b"batch")}
        made.add((await client.post("/v1/files", files=files)).json()["id"])
    for limit in (1, 2, 3):
        seen: list[str] = []
        after: str | None = None
        while True:
            params = {"limit": str(limit), **({"after": after} if after else {})}
            page = (await client.get("/v1/files", params=params)).json()
            seen += [f["id"] for f in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert len(seen) == len(set(seen)) and made <= set(seen), limit


async def _batch_input(redis: Redis, owner: str) -> tuple[FileStore, str]:
    files = FileStore(redis, keys, 600)
    file_id = new_file_id()
    await files.append_lines(file_id, [b'{"custom_id": "1"}\n'])
    await files.register(file_id, owner, "batch", "in.jsonl", 19, 1)
    return files, file_id


def _batch_fields(file_id: str, owner: str) -> dict[str, str]:
    now = time.time()
    return {"id": new_batch_id(), "owner": owner, "input_file_id": file_id, "created_at": f"{now:.3f}"}


async def test_a_file_whose_batch_starts_between_the_check_and_the_delete_is_refused(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = "racer-" + secrets.token_hex(4)
    files, file_id = await _batch_input(redis, owner)
    batches = BatchState(redis, keys, 600)
    checked = FileStore.batch_reading
    created: list[str] = []

    async def batch_starts_after_the_check(store: FileStore, checked_id: str) -> str | None:
        reader = await checked(store, checked_id)
        if not created:  # another gateway creates a batch on the file right after this one looked
            batch = await batches.create(_batch_fields(file_id, owner), time.time() + 60)
            assert batch is not None
            created.append(batch.id)
        return reader

    monkeypatch.setattr(FileStore, "batch_reading", batch_starts_after_the_check)
    try:
        with pytest.raises(FileInUse) as refused:
            await files.delete(file_id, owner)
        assert refused.value.batch_id == created[0]
        assert await files.line_count(file_id) == 1 and await files.get(file_id, owner) is not None
    finally:
        await batches.retire(created[0])


async def test_a_batch_is_not_created_on_a_file_deleted_since_it_was_read(redis: Redis) -> None:
    owner = "racer-" + secrets.token_hex(4)
    files, file_id = await _batch_input(redis, owner)
    assert await files.get(file_id, owner) is not None  # what POST /v1/batches reads first
    assert await files.delete(file_id, owner)

    assert await BatchState(redis, keys, 600).create(_batch_fields(file_id, owner), time.time() + 60) is None
    assert not await redis.exists(keys.file(file_id))  # not brought back as a record without lines
