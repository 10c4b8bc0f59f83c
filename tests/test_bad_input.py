"""Bad input gets a clear 4xx naming the problem, never a 500 and never a lost or stuck job."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.conftest import Fleet
from tests.jobs_client import submit, wait_done

pytestmark = pytest.mark.module_fleet  # one gateway and one served worker for the module's tests


def error_of(reply: httpx.Response) -> dict[str, str]:
    error: dict[str, str] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 5),
        ("top_p", 0),
        ("top_k", -1),
        ("max_tokens", 0),
        ("seed", -3),
        ("stop", ["x"] * 17),
        ("stop", [""]),
        ("prompt", ""),
        ("messages", []),
    ],
)
async def test_an_invalid_parameter_gets_422_naming_the_field(
    client: httpx.AsyncClient, served: str, field: str, value: object
) -> None:
    body: dict[str, object] = {"model": served, "prompt": "Hello", field: value}
    if field == "messages":
        body.pop("prompt")
    reply = await client.post("/v1/jobs", json=body)
    assert reply.status_code == 422, reply.text
    assert error_of(reply)["message"].startswith(field)
    assert error_of(reply)["param"].startswith(field)


async def test_prompt_and_messages_together_or_neither_get_422(
    client: httpx.AsyncClient, served: str
) -> None:
    both = await client.post(
        "/v1/jobs", json={"model": served, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}
    )
    neither = await client.post("/v1/jobs", json={"model": served})
    for reply in (both, neither):
        assert reply.status_code == 422
        assert "exactly one of 'prompt' and 'messages'" in error_of(reply)["message"]


async def test_an_unknown_field_or_chat_role_gets_422(client: httpx.AsyncClient, served: str) -> None:
    extra = await client.post("/v1/jobs", json={"model": served, "prompt": "a", "temprature": 1})
    assert extra.status_code == 422 and error_of(extra)["param"] == "temprature"
    role = await client.post(
        "/v1/jobs", json={"model": served, "messages": [{"role": "robot", "content": "b"}]}
    )
    assert role.status_code == 422 and error_of(role)["param"] == "messages.0.role"


async def test_broken_json_gets_400_and_a_non_object_gets_422(client: httpx.AsyncClient, served: str) -> None:
    broken = await client.post(
        "/v1/jobs", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and "not valid JSON" in error_of(broken)["message"]
    listed = await client.post("/v1/jobs", json=["prompt"])
    assert listed.status_code == 422


async def test_an_unknown_model_gets_404(client: httpx.AsyncClient, served: str) -> None:
    reply = await client.post("/v1/jobs", json={"model": "no-such-model", "prompt": "Hello"})
    assert reply.status_code == 404
    assert error_of(reply)["code"] == "model_not_found"
    assert "no-such-model" in error_of(reply)["message"]


async def test_an_unknown_job_gets_404_on_every_route(client: httpx.AsyncClient, served: str) -> None:
    for method, path in [
        ("GET", "/v1/jobs/job_nope"),
        ("DELETE", "/v1/jobs/job_nope"),
        ("GET", "/v1/jobs/job_nope/events"),
    ]:
        reply = await client.request(method, path)
        assert reply.status_code == 404, (method, path)
        assert error_of(reply)["code"] == "job_not_found"


async def test_a_known_model_without_a_live_worker_gets_503(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    worker = fleet.start_worker(model_name)
    assert worker.terminate() == 0  # a stopping worker leaves the registry at once
    models = (await client.get("/v1/models")).json()["data"]
    assert model_name not in [m["id"] for m in models]
    reply = await client.post("/v1/jobs", json={"model": model_name, "prompt": "Hello"})
    assert reply.status_code == 503
    assert error_of(reply)["code"] == "no_live_worker"
    assert reply.headers["Retry-After"]


async def test_an_oversized_body_gets_413(fleet: Fleet, client: httpx.AsyncClient, served: str) -> None:
    reply = await client.post("/v1/jobs", json={"model": served, "prompt": "x" * 2_000_000})
    assert reply.status_code == 413
    assert "larger than" in error_of(reply)["message"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies as the body arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    streamed = await client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413


async def test_max_tokens_beyond_the_context_gets_422(client: httpx.AsyncClient, served: str) -> None:
    reply = await client.post("/v1/jobs", json={"model": served, "prompt": "Hello", "max_tokens": 100_000})
    assert reply.status_code == 422
    assert error_of(reply)["param"] == "max_tokens"
    assert error_of(reply)["code"] == "context_length_exceeded"


async def test_a_prompt_longer_than_the_context_fails_the_job_at_once(
    client: httpx.AsyncClient, served: str
) -> None:
    job = await submit(client, {"model": served, "prompt": "The quick brown fox. " * 400, "max_tokens": 4})
    done = await wait_done(client, job["id"], timeout_s=10)
    assert done["status"] == "failed"
    assert "context" in done["error"] and "tokens" in done["error"]
    assert done["timings"] is None or done["timings"]["ttft_s"] is None
    follow_up = await wait_done(
        client, (await submit(client, {"model": served, "prompt": "Hi", "max_tokens": 2}))["id"]
    )
    assert follow_up["status"] == "succeeded"


async def test_a_bad_wait_gets_422(client: httpx.AsyncClient, served: str) -> None:
    job = await submit(client, {"model": served, "prompt": "Hi", "max_tokens": 2})
    for wait in ("soon", "-1", "100000"):
        reply = await client.get(f"/v1/jobs/{job['id']}", params={"wait": wait})
        assert reply.status_code == 422 and error_of(reply)["param"] == "wait"


async def test_an_unknown_route_gets_404_in_the_error_envelope(
    client: httpx.AsyncClient, served: str
) -> None:
    reply = await client.get("/v1/nothing")
    assert reply.status_code == 404 and "no route" in error_of(reply)["message"]
    wrong_method = await client.put("/v1/jobs")
    assert wrong_method.status_code == 405


async def test_the_openapi_spec_lists_every_route(client: httpx.AsyncClient, served: str) -> None:
    spec = (await client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.")
    assert {
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/events",
        "/v1/models",
        "/healthz",
        "/readyz",
    } <= set(spec["paths"])
    assert "JobRequest" in spec["components"]["schemas"]
