"""CORS for web pages on other origins, and signed stream tokens for EventSource on a keyed gateway."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest

from gateway.streaming.tokens import StreamTokens
from tests.conftest import Fleet
from tests.jobs_client import read_events, submit

pytestmark = pytest.mark.module_fleet  # one gateway for the module's tests

PAGE = "http://page.example"


async def test_preflight_is_answered_on_every_route_without_a_key(fleet: Fleet) -> None:
    _, url = fleet.start_gateway(
        env={"ORTFLEET_CORS_ORIGINS": f"{PAGE}, http://other.example", "ORTFLEET_API_KEYS": "a:" + "k" * 20}
    )
    async with httpx.AsyncClient(base_url=url) as http:
        for method, path in [
            ("POST", "/v1/jobs"),
            ("GET", "/v1/jobs/job_x/events"),
            ("POST", "/v1/chat/completions"),
            ("DELETE", "/v1/jobs/job_x"),
            ("POST", "/tokenize"),
            ("GET", "/v1/models"),
        ]:
            reply = await http.options(
                path,
                headers={
                    "Origin": PAGE,
                    "Access-Control-Request-Method": method,
                    "Access-Control-Request-Headers": "authorization, content-type, last-event-id",
                },
            )
            assert reply.status_code == 200, (path, reply.text)
            assert reply.headers["access-control-allow-origin"] == PAGE
            assert method in reply.headers["access-control-allow-methods"]
            assert "authorization" in reply.headers["access-control-allow-headers"].lower()
        refused = await http.get("/v1/models", headers={"Origin": PAGE})
        assert refused.status_code == 401  # a key is still needed, and the page can read why
        assert refused.headers["access-control-allow-origin"] == PAGE
        stranger = await http.options(
            "/v1/jobs", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
        )
        assert stranger.status_code == 400 and "access-control-allow-origin" not in stranger.headers


async def test_without_cors_origins_no_cors_headers_are_sent(client: httpx.AsyncClient) -> None:
    reply = await client.get("/healthz", headers={"Origin": PAGE})
    assert "access-control-allow-origin" not in reply.headers


async def test_a_stream_token_opens_only_its_jobs_events_until_it_expires(
    fleet: Fleet, model_name: str
) -> None:
    key, other = "ofk_" + secrets.token_urlsafe(24), "ofk_" + secrets.token_urlsafe(24)
    env = {
        "ORTFLEET_API_KEYS": f"owner:{key},other:{other}",
        "ORTFLEET_STREAM_TOKEN_SECRET": secrets.token_hex(16),
        "ORTFLEET_CORS_ORIGINS": "*",
    }
    _, url = fleet.start_gateway(env=env)
    fleet.start_worker(model_name)
    owner = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        job = await submit(http, {"model": model_name, "prompt": "Hi", "max_tokens": 5}, **owner)
        other_job = await submit(http, {"model": model_name, "prompt": "Hi", "max_tokens": 5}, **owner)
        issued = await http.post(f"/v1/jobs/{job['id']}/stream-token", headers=owner)
        assert issued.status_code == 201
        grant = issued.json()
        assert grant["expires_at"] > time.time() and grant["events_url"].endswith(grant["token"])
        events = await read_events(http, job["id"], stream_token=grant["token"])
        assert events[-1].event == "done"

        wrong_job = await http.get(
            f"/v1/jobs/{other_job['id']}/events", params={"stream_token": grant["token"]}
        )
        assert wrong_job.status_code == 401
        altered = grant["token"][:-2] + ("AA" if not grant["token"].endswith("AA") else "BB")
        assert (await http.get(grant["events_url"].replace(grant["token"], altered))).status_code == 401
        not_events = await http.get(f"/v1/jobs/{job['id']}", params={"stream_token": grant["token"]})
        assert not_events.status_code == 401  # a token opens the events route only
        stranger = await http.post(
            f"/v1/jobs/{job['id']}/stream-token", headers={"Authorization": f"Bearer {other}"}
        )
        assert stranger.status_code == 404  # another key's job does not exist for it
        secret = env["ORTFLEET_STREAM_TOKEN_SECRET"].encode()
        expired, _ = StreamTokens(secret, 10).issue(job["id"], "owner", now=time.time() - 60)
        assert (
            await http.get(f"/v1/jobs/{job['id']}/events", params={"stream_token": expired})
        ).status_code == 401


async def test_stream_tokens_are_refused_clearly_when_no_secret_is_set(fleet: Fleet, model_name: str) -> None:
    key = "ofk_" + secrets.token_urlsafe(24)
    _, url = fleet.start_gateway(env={"ORTFLEET_API_KEYS": f"owner:{key}"})
    fleet.start_worker(model_name)
    owner = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        job = await submit(http, {"model": model_name, "prompt": "Hi", "max_tokens": 2}, **owner)
        reply = await http.post(f"/v1/jobs/{job['id']}/stream-token", headers=owner)
        assert reply.status_code == 501 and "ORTFLEET_STREAM_TOKEN_SECRET" in reply.json()["error"]["message"]
