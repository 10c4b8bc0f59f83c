"""API keys, tenant isolation, per-key limits and privacy, against real gateways and workers."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis
from starlette.routing import Route

from common.apikeys import KeyFile
from ortfleet.cli import build_parser
from tests.conftest import LOGS, Fleet, keys
from tests.jobs_client import read_events, submit, wait_done

pytestmark = pytest.mark.module_fleet  # one gateway for the module's tests; each starts its own workers

PUBLIC = {"/healthz", "/readyz", "/health", "/version"}
CONSOLE = {"/", "/console/job_x"}  # the console's page and assets: no key, and no data in them


def create_key(path: Path, name: str, *extra: str) -> str:
    """A new key in the keys file at `path`, made by `ortfleet keys create` run in this process (the
    command as a process: test_keys_can_be_created_listed_and_revoked); the key."""
    args = build_parser().parse_args(["keys", "create", name, "--file", str(path), *extra])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        assert not args.func(args)
    return printed.getvalue().strip().splitlines()[-1]


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    return tmp_path / "api-keys.json"


@pytest.fixture
def secured(fleet: Fleet, key_file: Path, model_name: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A gateway that requires keys, a worker, and two tenants' keys: alice and bob."""
    suffix = secrets.token_hex(4)  # tenants are Redis-wide: each test gets its own
    tokens = {who: create_key(key_file, f"{who}-{suffix}") for who in ("alice", "bob")}
    metrics_key = "scraper-" + "x" * 24
    env = {"ORTFLEET_API_KEYS_FILE": str(key_file), "ORTFLEET_METRICS_API_KEY": metrics_key}
    _, url = fleet.start_gateway(env=env)
    fleet.start_worker(model_name)
    yield url, {**tokens, "metrics": metrics_key}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def route_table() -> list[tuple[str, str]]:
    from gateway.app import build_app

    app = build_app()
    table = []
    for route in app.routes:
        assert isinstance(route, Route)
        path = re.sub(r"\{[^}]+\}", "job_x", route.path)
        for method in sorted(route.methods or {"GET"}):
            if method != "HEAD":
                table.append((method, path))
    return table


async def test_every_non_public_route_answers_401_without_a_key_or_with_a_wrong_one(
    secured: tuple[str, dict[str, str]],
) -> None:
    url, _tokens = secured
    table = route_table()
    assert len(table) >= 10
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        for method, path in table:
            if path in PUBLIC:
                assert (await client.request(method, path)).status_code in (200, 503)
                continue
            if path in CONSOLE:
                assert (await client.request(method, path)).status_code in (200, 404)  # no asset job_x
                continue
            for headers in ({}, bearer("ofk_wrong"), {"Authorization": "Basic YWxpY2U6eA=="}):
                reply = await client.request(method, path, headers=headers, json={})
                assert reply.status_code == 401, (method, path, headers, reply.text)
                assert reply.json()["error"]["type"] == "authentication_error"
                assert reply.headers["WWW-Authenticate"].startswith("Bearer")
        scraped = await client.get("/metrics", headers=bearer(_tokens["metrics"]))
        assert scraped.status_code == 200 and "ortfleet_" in scraped.text
        assert (await client.get("/metrics", headers=bearer(_tokens["alice"]))).status_code == 401


async def test_another_tenants_job_is_not_found_on_every_job_route(
    secured: tuple[str, dict[str, str]], model_name: str
) -> None:
    url, tokens = secured
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(tokens["alice"])) as alice:
        job = await submit(alice, {"model": model_name, "prompt": "Secret plans", "max_tokens": 4})
        await wait_done(alice, job["id"])
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(tokens["bob"])) as bob:
            for method, path in [
                ("GET", f"/v1/jobs/{job['id']}"),
                ("GET", f"/v1/jobs/{job['id']}/events"),
                ("DELETE", f"/v1/jobs/{job['id']}"),
                ("DELETE", f"/v1/jobs/{job['id']}?purge=true"),
            ]:
                reply = await bob.request(method, path)
                assert reply.status_code == 404, (method, path)
                assert "does not exist" in reply.json()["error"]["message"]
            assert (await bob.get("/v1/jobs")).json()["data"] == []
            same_key = {"Idempotency-Key": "shared-key"}
            first = await alice.post(
                "/v1/jobs", json={"model": model_name, "prompt": "a", "max_tokens": 2}, headers=same_key
            )
            second = await bob.post(
                "/v1/jobs", json={"model": model_name, "prompt": "b", "max_tokens": 2}, headers=same_key
            )
            assert first.json()["id"] != second.json()["id"]  # idempotency keys are per tenant
        assert (await alice.get(f"/v1/jobs/{job['id']}")).json()["output"] is not None


async def test_a_tenant_lists_only_its_own_jobs_newest_first_in_pages(
    secured: tuple[str, dict[str, str]], model_name: str
) -> None:
    url, tokens = secured
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(tokens["alice"])) as alice:
        mine = [
            (await submit(alice, {"model": model_name, "prompt": f"{i}", "max_tokens": 2}))["id"]
            for i in range(5)
        ]
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(tokens["bob"])) as bob:
            await submit(bob, {"model": model_name, "prompt": "theirs", "max_tokens": 2})
        first = (await alice.get("/v1/jobs", params={"limit": 3})).json()
        assert [j["id"] for j in first["data"]] == mine[::-1][:3]
        assert first["has_more"] is True
        rest = (await alice.get("/v1/jobs", params={"limit": 3, "after": first["next_cursor"]})).json()
        assert [j["id"] for j in rest["data"]] == mine[::-1][3:]
        assert rest["has_more"] is False
        bad = await alice.get("/v1/jobs", params={"limit": 0})
        assert bad.status_code == 422


async def test_job_ids_are_unguessable(secured: tuple[str, dict[str, str]], model_name: str) -> None:
    url, tokens = secured
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(tokens["alice"])) as alice:
        ids = [
            (await submit(alice, {"model": model_name, "prompt": "x", "max_tokens": 1}))["id"]
            for _ in range(3)
        ]
    assert len(set(ids)) == 3
    assert all(len(i.removeprefix("job_")) >= 24 for i in ids)  # at least 144 random bits


async def test_per_key_limits_hold_across_two_gateway_processes(
    fleet: Fleet, key_file: Path, model_name: str
) -> None:
    token = create_key(key_file, "busy", "--max-concurrent-jobs", "2", "--requests-per-minute", "6")
    env = {"ORTFLEET_API_KEYS_FILE": str(key_file)}
    _, first_url = fleet.start_gateway(env=env)
    _, second_url = fleet.start_gateway(env=env)
    worker = fleet.start_worker(model_name)
    worker.pause()
    try:
        body = {"model": model_name, "prompt": "x", "max_tokens": 2}
        async with (
            httpx.AsyncClient(base_url=first_url, timeout=10, headers=bearer(token)) as one,
            httpx.AsyncClient(base_url=second_url, timeout=10, headers=bearer(token)) as two,
        ):
            assert (await one.post("/v1/jobs", json=body)).status_code == 202
            assert (await two.post("/v1/jobs", json=body)).status_code == 202
            too_many = await one.post("/v1/jobs", json=body)
            assert too_many.status_code == 429 and too_many.headers["Retry-After"]
            assert "2 active jobs" in too_many.json()["error"]["message"]
            codes = [(await client.get("/v1/models")).status_code for client in (one, two, one, two)]
            assert codes == [200, 200, 200, 429]  # the 7th request in a minute, counted across both gateways
            assert 1 <= int((await one.get("/v1/models")).headers["Retry-After"]) <= 60
    finally:
        worker.resume()


def test_keys_can_be_created_listed_and_revoked(key_file: Path) -> None:
    token = create_key(key_file, "ci-bot", "--requests-per-minute", "30")
    assert token.startswith("ofk_") and len(token) > 40
    stored = key_file.read_text()
    assert token not in stored and "ci-bot" in stored  # only the hash is kept
    assert oct(key_file.stat().st_mode)[-3:] == "600"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ortfleet", "keys", *args, "--file", str(key_file)],
            capture_output=True,
            text=True,
        )

    listed = cli("list")
    assert listed.returncode == 0 and "ci-bot" in listed.stdout and token not in listed.stdout
    assert cli("create", "ci-bot").returncode == 1  # names are unique
    assert cli("revoke", "ci-bot").returncode == 0
    assert [k.name for k in KeyFile.load(key_file).keys] == []
    assert cli("revoke", "ci-bot").returncode == 1


async def test_a_revoked_key_stops_working_without_a_restart(
    secured: tuple[str, dict[str, str]], key_file: Path
) -> None:
    url, tokens = secured
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=bearer(tokens["bob"])) as bob:
        assert (await bob.get("/v1/models")).status_code == 200
        revoked = KeyFile.load(key_file)
        revoked.revoke(next(k.name for k in revoked.keys if k.name.startswith("bob-")))
        revoked.save()
        deadline = time.monotonic() + 5  # the gateway re-reads a changed keys file within a second
        while (await bob.get("/v1/models")).status_code != 401:
            assert time.monotonic() < deadline, "a revoked key still works"
            await asyncio.sleep(0.05)


async def test_a_purged_job_is_gone_from_redis(
    secured: tuple[str, dict[str, str]], model_name: str, redis: Redis
) -> None:
    url, tokens = secured
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(tokens["alice"])) as alice:
        job = await submit(
            alice, {"model": model_name, "prompt": "forget me", "max_tokens": 4}, **{"Idempotency-Key": "p1"}
        )
        await wait_done(alice, job["id"])
        reply = await alice.delete(f"/v1/jobs/{job['id']}", params={"purge": "true"})
        assert reply.status_code == 204
        assert [k async for k in redis.scan_iter(f"*{job['id']}*")] == []
        owners = [k async for k in redis.scan_iter(keys.owner_jobs("*"))]
        for owner in owners:
            assert job["id"] not in await redis.zrange(owner, 0, -1)
        assert (await alice.get(f"/v1/jobs/{job['id']}")).status_code == 404
        running = await submit(alice, {"model": model_name, "prompt": "stop and forget", "max_tokens": 400})
        await read_events(alice, running["id"])  # let it start and finish or not: purge works either way
        assert (await alice.delete(f"/v1/jobs/{running['id']}", params={"purge": "true"})).status_code == 204
        assert [k async for k in redis.scan_iter(f"*{running['id']}*")] == []


async def test_no_prompt_or_output_text_reaches_the_logs_at_the_default_level(
    fleet: Fleet, model_name: str
) -> None:
    _, url = fleet.start_gateway()  # of this test's own: its log is read below
    fleet.start_worker(model_name)
    canary = "zebra-canary-7781"
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        body = {"model": model_name, "prompt": f"My password is {canary}", "max_tokens": 16}
        done = await wait_done(client, (await submit(client, body))["id"])
        bad = await client.post("/v1/jobs", json={"model": model_name, "prompt": canary, "temperature": 9})
    assert bad.status_code == 422
    fleet.stop_all()
    assert [proc.role for proc in fleet.processes] == ["gateway", "worker"]
    for proc in fleet.processes:
        text = proc.log.read_text(errors="replace")
        assert canary not in text, proc.log
        assert not done["output"] or done["output"] not in text or len(done["output"]) < 4
    assert LOGS.exists()


def test_the_gateway_refuses_a_public_address_without_keys_unless_told_to(tmp_path: Path) -> None:
    from ortfleet.fleet.processes import free_port

    port = free_port()
    refused = subprocess.run(
        [sys.executable, "-m", "gateway", "--host", "0.0.0.0", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0
    assert "--allow-anonymous" in refused.stderr
