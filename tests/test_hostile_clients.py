"""Hostile and careless clients against a real fleet with two keys: no request may crash a worker,
exhaust Redis, hang the gateway, or get a 5xx for what it sent."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from common.gateway_settings import GatewaySettings
from common.jobs.queue import JobQueue
from common.jobs.submission import QueueLimits
from common.wire import ChatMessage, JobSpec, Sampling
from ortfleet.fleet.processes import free_port, start_redis, stop
from tests.conftest import LOGS, Fleet, Proc, RedisServer, keys
from tests.jobs_client import read_events, submit, wait_done
from tests.test_observability import value
from tests.test_security import bearer, create_key
from tests.waiting import until_seen

LIMITS = {
    "ORTFLEET_HEADER_TIMEOUT_S": "1",
    "ORTFLEET_BODY_TIMEOUT_S": "1",
    "ORTFLEET_KEY_MAX_OPEN_STREAMS": "4",
    "ORTFLEET_KEY_MAX_CONCURRENT_JOBS": "16",
    "ORTFLEET_SSE_KEEPALIVE_S": "1",
}


@dataclass
class Tenants:
    url: str
    model: str
    mallory: dict[str, str]  # the hostile key's headers
    alice: dict[str, str]  # a well-behaved key's headers
    mallory_name: str
    alice_name: str
    worker: Proc


@pytest.fixture(scope="module")
def tenants(
    redis_server: RedisServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tenants]:
    """One fleet for the module: a gateway with short limits, a worker, and two keys."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.json"
    suffix = secrets.token_hex(4)
    mallory = create_key(key_file, f"mallory-{suffix}")
    alice = create_key(key_file, f"alice-{suffix}")
    fleet = Fleet(redis_server.url, tiny_model)
    try:
        _, url = fleet.start_gateway(env={"ORTFLEET_API_KEYS_FILE": str(key_file), **LIMITS})
        model = "tiny-hostile-" + suffix
        worker = fleet.start_worker(model)
        yield Tenants(
            url, model, bearer(mallory), bearer(alice), f"mallory-{suffix}", f"alice-{suffix}", worker
        )
    finally:
        fleet.stop_all()


async def never_running_job(redis: Redis, tenants: Tenants) -> str:
    """A job of mallory's, queued for a model no worker serves: its stream stays open."""
    queue = JobQueue(redis, 3600, keys)
    spec = JobSpec(
        id="job_idle_" + secrets.token_hex(6),
        model=tenants.model + "-nowhere",
        prompt="Hi",
        sampling=Sampling(max_tokens=1),
        submitted_at=time.time(),
    )
    await queue.submit(spec, limits=QueueLimits(100, 10**6, 0), cost=1, owner=tenants.mallory_name)
    return spec.id


def raw_json(text: str) -> dict[str, str]:
    return {"content-type": "application/json", "content": text}  # type: ignore[dict-item]


def rejections(text: str, reason: str) -> float:
    for line in text.splitlines():
        if line.startswith("ortfleet_requests_rejected_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


HI = [{"role": "user", "content": "hi"}]
TEXT_FIELDS: list[tuple[str, dict[str, object], str]] = [
    ("/v1/jobs", {"prompt": "a@b"}, "prompt"),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "a@b"}]}, "messages.0.content"),
    ("/v1/jobs", {"prompt": "hi", "stop": ["x@"]}, "stop.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a@b"}]}, "messages.0.content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "@"}]}]},
        "messages.0.content.0.text",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi", "name": "@"}]},
        "messages.0.name",
    ),
    ("/v1/chat/completions", {"messages": HI, "stop": "@"}, "stop"),
    ("/v1/chat/completions", {"messages": HI, "user": "@"}, "user"),
    ("/v1/completions", {"prompt": "a@b"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a@b"]}, "prompt.1"),
    ("/v1/completions", {"prompt": "hi", "x@": 1}, "x\\ud800"),
]


@pytest.mark.parametrize(("path", "fields", "param"), TEXT_FIELDS)
async def test_a_lone_surrogate_in_any_text_field_of_any_route_gets_400_naming_the_field(
    tenants: Tenants, path: str, fields: dict[str, object], param: str
) -> None:
    body = json.dumps({"model": tenants.model, **fields}).replace("@", "\\ud800")  # JSON's escape
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        reply = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_text"
    assert "surrogate" in error["message"]


async def test_a_worker_fails_a_job_whose_prompt_breaks_the_chat_template_and_keeps_serving(
    tenants: Tenants, redis: Redis
) -> None:
    """A job written straight into Redis (past the gateway's checks) must not take its worker down."""
    model_name = tenants.model
    queue = JobQueue(redis, 3600, keys)
    spec = JobSpec(
        id="job_surrogate_" + secrets.token_hex(6),
        model=model_name,
        messages=[ChatMessage(role="user", content="a\ud800b")],
        sampling=Sampling(max_tokens=4),
        submitted_at=time.time(),
    )
    await queue.submit(spec, limits=QueueLimits(100, 10**6, 0), cost=10, owner=tenants.alice_name)
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=30) as client:
        failed = await wait_done(client, spec.id, timeout_s=20)
        assert failed["status"] == "failed" and failed["attempts"] == 1
        assert failed["error_code"] == "invalid_prompt"
        assert tenants.worker.process.poll() is None, tenants.worker.log_tail()
        after = await wait_done(client, (await submit(client, {"model": model_name, "prompt": "Hi"}))["id"])
    assert after["status"] == "succeeded"


async def test_one_key_cannot_open_more_streams_than_its_cap_and_another_key_still_can(
    tenants: Tenants, redis: Redis
) -> None:
    job_id = await never_running_job(redis, tenants)
    async with (
        httpx.AsyncClient(base_url=tenants.url, headers=tenants.mallory, timeout=30) as mallory,
        httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=30) as alice,
    ):
        async with contextlib_streams(mallory, f"/v1/jobs/{job_id}/events", 4) as opened:
            assert [r.status_code for r in opened] == [200] * 4
            for refused in (
                await mallory.get(f"/v1/jobs/{job_id}", params={"wait": 5}),
                await mallory.get(f"/v1/jobs/{job_id}/events"),
            ):
                assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_streams"
            theirs = await submit(alice, {"model": tenants.model, "prompt": "Hi", "max_tokens": 4})
            assert (await wait_done(alice, theirs["id"]))["status"] == "succeeded"
        # the slots come back once the streams end
        assert (await mallory.get(f"/v1/jobs/{job_id}", params={"wait": 0.5})).status_code == 200
        metrics = (await alice.get("/metrics")).text
    assert rejections(metrics, "too_many_streams") >= 1


async def test_streamed_and_waiting_responses_hold_stream_slots_and_give_them_back(
    tenants: Tenants, redis: Redis
) -> None:
    """The Responses API's streams and foreground calls count against the key's cap, as job streams do:
    refused with 429 before anything is submitted, and their slots come back when they end."""
    job_id = await never_running_job(redis, tenants)
    ask = {"model": tenants.model, "input": "Hi", "max_output_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.mallory, timeout=30) as mallory:
        background = await mallory.post("/v1/responses", json={**ask, "background": True})
        assert background.status_code == 200, background.text
        stored = await redis.keys(keys.response("*"))
        async with contextlib_streams(mallory, f"/v1/jobs/{job_id}/events", 4) as opened:
            assert [r.status_code for r in opened] == [200] * 4
            for refused in (
                await mallory.post("/v1/responses", json={**ask, "stream": True}),
                await mallory.post("/v1/responses", json=ask),
                await mallory.get(f"/v1/responses/{background.json()['id']}", params={"stream": "true"}),
            ):
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["code"] == "too_many_streams"
            assert sorted(await redis.keys(keys.response("*"))) == sorted(stored)  # nothing submitted
        async with contextlib_streams(mallory, f"/v1/jobs/{job_id}/events", 3) as opened:
            assert [r.status_code for r in opened] == [200] * 3
            streamed = await mallory.post("/v1/responses", json={**ask, "stream": True})
            assert streamed.status_code == 200, streamed.text
            last_event = streamed.text.strip().split("\n\n")[-1].split("\n")[0]
            assert last_event in ("event: response.completed", "event: response.incomplete")
            waited = await mallory.post("/v1/responses", json=ask)
            assert waited.status_code == 200 and waited.json()["status"] in ("completed", "incomplete")
            # both gave their slot back: the key's fourth is free again
            async with contextlib_streams(mallory, f"/v1/jobs/{job_id}/events", 1) as fourth:
                assert fourth[0].status_code == 200


class contextlib_streams:
    """`count` event streams held open (read from 0-0 with keep-alives until closed)."""

    def __init__(self, client: httpx.AsyncClient, path: str, count: int) -> None:
        self.client, self.path, self.count = client, path, count
        self.responses: list[httpx.Response] = []

    async def __aenter__(self) -> list[httpx.Response]:
        for _ in range(self.count):
            request = self.client.build_request("GET", self.path, params={"after": "0-0"})
            response = await self.client.send(request, stream=True)
            self.responses.append(response)
        return self.responses

    async def __aexit__(self, *exc: object) -> None:
        for response in self.responses:
            await response.aclose()


async def test_events_read_after_the_end_of_a_finished_job_end_at_once(tenants: Tenants) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        job = await submit(client, {"model": tenants.model, "prompt": "Hi", "max_tokens": 4})
        await wait_done(client, job["id"])
        events = await read_events(client, job["id"])
        started = time.monotonic()
        past_end = await client.get(f"/v1/jobs/{job['id']}/events", params={"after": events[-1].id})
        assert past_end.status_code == 200 and past_end.text == ""
        beyond = await client.get(f"/v1/jobs/{job['id']}/events", params={"after": "99999999999999-0"})
        assert beyond.status_code == 200 and beyond.text == ""
    assert time.monotonic() - started < 2


@pytest.mark.parametrize(
    "after",
    [
        "9999999999999999999999999-0",
        "1-0\n",
        "\u0661\u0662-\u0660",
        "²-0",
        "18446744073709551616-0",
        "-1-0",
        "1-0-0",
    ],
)
async def test_an_event_id_that_redis_would_refuse_gets_422_before_the_stream_starts(
    tenants: Tenants, after: str
) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        job = await submit(client, {"model": tenants.model, "prompt": "Hi", "max_tokens": 2})
        by_query = await client.get(f"/v1/jobs/{job['id']}/events", params={"after": after})
        assert by_query.status_code == 422 and by_query.json()["error"]["param"] == "after"
        if "\n" not in after and after.isascii():
            by_header = await client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": after})
            assert by_header.status_code == 422


# Arabic-Indic one and fullwidth zero are digits to str.isdigit and int(), as "2_0" and " 2" are to int()
ODD_NUMBERS = ["\u0661", "2_0", " 2", "2 ", "+2", "\uff10", "1e3", "-2", "9" * 40]


@pytest.mark.parametrize("value", ODD_NUMBERS)
async def test_a_starting_after_that_is_not_a_plain_sequence_number_gets_400_naming_it(
    tenants: Tenants, value: str
) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        created = await client.post(
            "/v1/responses",
            json={"model": tenants.model, "input": "Hi", "max_output_tokens": 1, "background": True},
        )
        reply = await client.get(
            f"/v1/responses/{created.json()['id']}", params={"stream": "true", "starting_after": value}
        )
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "starting_after"
        fine = await client.get(
            f"/v1/responses/{created.json()['id']}", params={"stream": "true", "starting_after": "0"}
        )
        assert fine.status_code == 200 and "text/event-stream" in fine.headers["content-type"]


@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches"])
@pytest.mark.parametrize("value", [*ODD_NUMBERS, "file-a b", "batch_\u00e9", ""])
async def test_a_list_cursor_that_is_no_id_gets_400_naming_after(
    tenants: Tenants, path: str, value: str
) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        reply = await client.get(path, params={"after": value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "after"


@pytest.mark.parametrize("value", [*ODD_NUMBERS, "nan", "inf"])
async def test_a_wait_that_is_not_a_plain_number_of_seconds_gets_422_naming_it(
    tenants: Tenants, value: str
) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        job = await submit(client, {"model": tenants.model, "prompt": "Hi", "max_tokens": 1})
        reply = await client.get(f"/v1/jobs/{job['id']}", params={"wait": value})
        assert reply.status_code == 422, reply.text
        assert reply.json()["error"]["param"] == "wait"
        assert (await client.get(f"/v1/jobs/{job['id']}", params={"wait": "0.5"})).status_code == 200


@pytest.mark.parametrize("query", [{"limit": "²"}, {"after": "²"}, {"limit": "9" * 5000}, {"after": "1"}])
async def test_odd_digits_in_the_job_list_query_get_422(tenants: Tenants, query: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        reply = await client.get("/v1/jobs", params=query)
    assert reply.status_code == 422, reply.text


METADATA_ROUTES: list[tuple[str, dict[str, object]]] = [
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    (
        "/v1/batches",
        {"input_file_id": "file-none", "endpoint": "/v1/completions", "completion_window": "24h"},
    ),
]


@pytest.mark.parametrize(("path", "fields"), METADATA_ROUTES)
@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": "v" * 500_000},
    ],
    ids=["17-pairs", "key-65", "value-513", "value-500k"],
)
async def test_metadata_past_openais_bounds_gets_400_naming_it(
    tenants: Tenants, path: str, fields: dict[str, object], metadata: dict[str, str]
) -> None:
    """OpenAI's bounds: 16 pairs, keys of at most 64 characters, values of at most 512."""
    body = {"model": tenants.model, **fields, "metadata": metadata}
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        reply = await client.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "metadata" and error["message"].startswith("metadata: "), error
    assert len(reply.content) < 2000  # the message names the bound, without echoing the value


@pytest.mark.parametrize(("path", "fields"), METADATA_ROUTES)
async def test_metadata_at_openais_bounds_is_taken(
    tenants: Tenants, path: str, fields: dict[str, object]
) -> None:
    metadata = {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}
    body = {"model": tenants.model, **fields, "metadata": metadata}
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=30) as client:
        reply = await client.post(path, json=body)
    if path == "/v1/batches":  # past the body's checks: the file is looked up
        assert reply.status_code == 404 and reply.json()["error"]["param"] == "input_file_id", reply.text
    else:
        assert reply.status_code == 200 and reply.json()["metadata"] == metadata, reply.text


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("[" * 100_000, "json_too_deep"),
        ('{"a":' * 100_000, "json_too_deep"),
        ('{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", "number_too_long"),
        ('{"prompt": "hi", "seed": 1' + "0" * 5000 + "}", "number_too_long"),
        ('{"prompt": "hi", "temperature": NaN}', "invalid_json"),
        ('{"prompt": "hi", "temperature": 1e99999}', "number_out_of_range"),
    ],
)
async def test_deep_nesting_huge_numbers_and_nan_get_400_on_every_post_route(
    tenants: Tenants, path: str, body: str, code: str
) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        reply = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == code


async def test_paging_through_a_keys_jobs_lists_each_job_exactly_once_at_any_page_size(
    tenants: Tenants, redis: Redis
) -> None:
    """Jobs submitted in the same millisecond share a score: the cursor must not skip any of them."""
    queue = JobQueue(redis, 3600, keys)
    now = time.time()
    ids = []
    for i in range(23):
        spec = JobSpec(
            id=f"job_page{i:02d}_{secrets.token_hex(4)}",
            model=tenants.model + "-nowhere",
            prompt="Hi",
            sampling=Sampling(max_tokens=1),
            submitted_at=now - (i // 5) * 0.001,  # five per millisecond
        )
        await queue.submit(spec, limits=QueueLimits(100, 10**6, 0), cost=1, owner=tenants.mallory_name)
        ids.append(spec.id)
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.mallory, timeout=10) as client:
        for limit in (1, 7, 20):
            seen: list[str] = []
            params = {"limit": str(limit)}
            while True:
                page = (await client.get("/v1/jobs", params=params)).json()
                seen += [job["id"] for job in page["data"]]
                if not page["has_more"]:
                    break
                params = {"limit": str(limit), "after": page["next_cursor"]}
            assert len(seen) == len(set(seen)), limit
            assert sorted(s for s in seen if s.startswith("job_page")) == sorted(ids), limit


async def test_more_choices_than_the_keys_active_job_limit_get_400_at_once(tenants: Tenants) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        before = (await client.get("/v1/jobs", params={"limit": "1"})).json()["data"]
        reply = await client.post(
            "/v1/completions", json={"model": tenants.model, "prompt": "Hi", "n": 17, "max_tokens": 2}
        )
        after = (await client.get("/v1/jobs", params={"limit": "1"})).json()["data"]
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "too_many_choices"
    assert after == before  # no job was created


async def test_readers_of_a_purged_job_are_told_and_stop_waiting(fleet: Fleet, tmp_path: Path) -> None:
    key_file = tmp_path / "keys.json"
    token = create_key(key_file, f"purger-{secrets.token_hex(4)}")
    _, url = fleet.start_gateway(env={"ORTFLEET_API_KEYS_FILE": str(key_file), **LIMITS})
    model = "tiny-purged-" + secrets.token_hex(3)
    fleet.start_worker(model, "--max-batch-size", "1", env={"ORTFLEET_STEP_DELAY_S": "0.2"})
    async with httpx.AsyncClient(base_url=url, headers=bearer(token), timeout=30) as client:
        job = await submit(client, {"model": model, "prompt": "Hi", "max_tokens": 200})
        connected = asyncio.Event()
        reader = asyncio.ensure_future(read_events(client, job["id"], connected=connected))
        chat = asyncio.ensure_future(
            client.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200},
            )
        )

        async def both_jobs_listed() -> bool:  # the chat call's job queued behind the first
            return len((await client.get("/v1/jobs")).json()["data"]) == 2

        await asyncio.wait_for(connected.wait(), 10)
        await until_seen(both_jobs_listed, "the chat call's job submitted", 10)
        for job_id in [job["id"], *(j["id"] for j in (await client.get("/v1/jobs")).json()["data"])]:
            await client.delete(f"/v1/jobs/{job_id}", params={"purge": "true"})
        started = time.monotonic()
        events, answer = await asyncio.wait_for(asyncio.gather(reader, chat), 10)
    assert events[-1].event == "error" and events[-1].data["code"] == "job_purged"
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "job_purged"
    assert time.monotonic() - started < 5


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


async def test_a_huge_request_head_gets_431_without_a_key_and_is_counted(tenants: Tenants) -> None:
    def send_huge() -> bytes:
        with _connect(tenants.url) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
            try:
                for _ in range(128):  # up to 8 MB; the gateway answers and closes long before
                    sock.sendall(b"a" * 65536)
            except OSError:
                pass
            return _read_all(sock)

    answer = await asyncio.to_thread(send_huge)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        assert (await client.get("/healthz")).status_code == 200
        assert rejections((await client.get("/metrics")).text, "header_too_large") >= 1


@pytest.mark.parametrize(
    ("sent", "answer"),
    [
        (b"", b""),  # connects and sends nothing
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: a", b"HTTP/1.1 408"),
        (b'POST /v1/jobs HTTP/1.1\r\nHost: x\r\nKEY\r\nContent-Length: 100\r\n\r\n{"pro', b"HTTP/1.1 408"),
    ],
)
async def test_slowloris_connections_are_closed_after_the_read_timeouts(
    tenants: Tenants, sent: bytes, answer: bytes
) -> None:
    def hold() -> tuple[bytes, float]:
        with _connect(tenants.url) as sock:
            started = time.monotonic()
            if sent:
                key = b"Authorization: " + tenants.alice["Authorization"].encode()
                sock.sendall(sent.replace(b"KEY", key))
            return _read_all(sock), time.monotonic() - started

    got, took = await asyncio.to_thread(hold)
    assert got.startswith(answer) and took < 4, (got[:80], took)


async def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_time_not_before(
    fleet: Fleet,
) -> None:
    """The gateway, not only the client, ends an idle connection, after ORTFLEET_KEEP_ALIVE_S; by
    default later than HTTP clients' pools give up theirs, so a client never reuses a connection the
    gateway is closing (a failed request)."""
    assert GatewaySettings().keep_alive_s > httpx.Limits().keepalive_expiry  # httpx's, the OpenAI SDK's
    _, url = fleet.start_gateway(env={"ORTFLEET_KEEP_ALIVE_S": "1.5"})

    def idle_until_closed() -> tuple[bytes, float]:
        with _connect(url) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = sock.recv(65536)
            answered = time.monotonic()
            rest = _read_all(sock)  # until the gateway closes the connection
            return answer + rest, time.monotonic() - answered

    answer, idle_for = await asyncio.to_thread(idle_until_closed)
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1
    assert 1.4 <= idle_for < 4, idle_for  # uvicorn's own default would be 5 s


async def test_requests_pipelined_on_one_connection_are_answered_in_order(tenants: Tenants) -> None:
    """HTTP/1.1 pipelining: a client sends its next requests before the first is answered; the gateway
    queues them and answers each in turn."""
    key = b"Authorization: " + tenants.alice["Authorization"].encode()
    paths = [b"/healthz", b"/v1/models", b"/v1/jobs/no-such-job", b"/healthz"]
    heads = [b"GET %b HTTP/1.1\r\nHost: x\r\n%b\r\n" % (path, key) for path in paths]
    heads[-1] += b"Connection: close\r\n"

    def pipeline() -> bytes:
        with _connect(tenants.url) as sock:
            sock.sendall(b"".join(head + b"\r\n" for head in heads))
            return _read_all(sock)

    answer = await asyncio.to_thread(pipeline)
    assert re.findall(rb"HTTP/1.1 (\d{3}) ", answer) == [b"200", b"200", b"404", b"200"]
    assert b"tiny-hostile-" in answer  # the models list, answered second


async def test_a_stalled_redis_gets_503_store_timeout_and_the_fleet_serves_again_at_once(
    tmp_path: Path, tiny_model: Path
) -> None:
    port = free_port()
    server = start_redis(port, tmp_path / "redis", log=LOGS / f"redis-stall-{port}.log")
    env = {"ORTFLEET_REDIS_SOCKET_TIMEOUT_S": "0.5", "ORTFLEET_HEARTBEAT_TTL_S": "1"}
    fleet = Fleet(f"redis://127.0.0.1:{port}/0", tiny_model, env=env)
    try:
        fleet.start_gateway()
        fleet.start_worker("tiny-stall")
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as client:
            server.send_signal(19)  # SIGSTOP: Redis stalls
            try:
                started = time.monotonic()
                stalled = await client.post("/v1/jobs", json={"model": "tiny-stall", "prompt": "Hi"})
                took = time.monotonic() - started
                await asyncio.sleep(2.5 - took)  # past the heartbeat TTL
            finally:
                server.send_signal(18)  # SIGCONT
            assert stalled.status_code == 503 and stalled.json()["error"]["code"] == "store_timeout"
            assert took < 3
            deadline = time.monotonic() + 2
            ready = await client.get("/readyz")
            while ready.status_code != 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                ready = await client.get("/readyz")
            assert ready.status_code == 200, ready.text
            job = await submit(client, {"model": "tiny-stall", "prompt": "Hi", "max_tokens": 4})
            assert (await wait_done(client, job["id"]))["status"] == "succeeded"
    finally:
        fleet.stop_all()
        stop(server)


async def test_a_client_that_aborts_its_upload_is_not_counted_as_a_server_error(tenants: Tenants) -> None:
    def abort() -> None:
        with _connect(tenants.url) as sock:
            token = tenants.alice["Authorization"]
            sock.sendall(
                b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: " + token.encode()
                + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\""
            )  # fmt: skip
            time.sleep(0.2)  # the client's upload stalls halfway, then it goes away

    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:

        async def submissions_counted() -> float:
            text = (await client.get("/metrics")).text
            return value(text, "ortfleet_http_requests_total", route="/v1/jobs", method="POST") or 0.0

        async def abort_counted() -> bool:
            return await submissions_counted() > before

        before = await submissions_counted()
        await asyncio.to_thread(abort)
        await until_seen(abort_counted, "the aborted upload counted", 10)
        metrics = (await client.get("/metrics")).text
    assert 'status="500"' not in metrics


async def test_messages_name_what_was_sent_and_a_key_sees_no_fleet_load(tenants: Tenants) -> None:
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.alice, timeout=10) as client:
        too_many = await client.post(
            "/v1/chat/completions",
            json={
                "model": tenants.model,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 1_000_000,
            },
        )
        models = (await client.get("/v1/models")).json()["data"]
        ready = (await client.get("/readyz", headers={"Authorization": ""})).json()
    assert all(set(model) == {"workers"} for model in ready["models"].values())
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "max_completion_tokens"
    assert too_many.json()["error"]["message"].startswith("max_completion_tokens")
    assert all("in_flight" not in model for model in models)


async def test_abandoned_long_polls_give_back_their_slots_and_connections_at_once(
    tenants: Tenants, redis: Redis
) -> None:
    job_id = await never_running_job(redis, tenants)
    async with httpx.AsyncClient(base_url=tenants.url, headers=tenants.mallory, timeout=0.5) as client:
        for _ in range(4):  # each client leaves long before its 30 s wait is over
            with pytest.raises(httpx.ReadTimeout):
                await client.get(f"/v1/jobs/{job_id}", params={"wait": 30})
    async with (
        httpx.AsyncClient(base_url=tenants.url, headers=tenants.mallory, timeout=10) as mallory,
        contextlib_streams(mallory, f"/v1/jobs/{job_id}/events", 4) as opened,
    ):
        assert [r.status_code for r in opened] == [200] * 4
