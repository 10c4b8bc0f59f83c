"""LoRA adapters loaded and unloaded at run time over HTTP (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), on real gateways, workers and Redis: a load reaches every live worker of the model
and a worker that starts later, requests name the adapter at once and get the tokens of a worker given it
at start; an adapter that does not fit is refused naming why and kept by no worker; an unload ends new
requests (404) while running ones finish and queued ones fail naming it. Operators only: off unless
enabled, and with API keys on, only the admin key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from httpx_sse import aconnect_sse

from ortfleet.fleet.processes import free_port
from tests.conftest import Fleet
from tests.jobs_client import submit, wait_done
from tests.test_lora import write_adapter
from tests.test_lora_fleet import job_tokens
from tests.test_observability import value

ENABLED = {"ORTFLEET_ALLOW_RUNTIME_LORA_UPDATING": "true"}
ALICE, ADMIN = "sk-alice-0123456789abcdef", "sk-admin-0123456789abcdef"


@pytest.fixture
def sql(tmp_path: Path, tiny_model: Path) -> Path:
    return write_adapter(tmp_path / "sql", tiny_model, seed=1, strength=2.0)


@pytest.fixture
async def admin(fleet: Fleet) -> Any:
    """A client of a gateway of the fleet's on which runtime loading is on."""
    _, url = fleet.start_gateway(env=ENABLED)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        yield http


async def load(
    client: httpx.AsyncClient, model: str | None, name: str, path: Path, **headers: str
) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)} | ({"model": model} if model else {})
    return await client.post("/v1/load_lora_adapter", json=body, headers=headers)


async def unload(client: httpx.AsyncClient, model: str, name: str) -> httpx.Response:
    return await client.post("/v1/unload_lora_adapter", json={"model": model, "lora_name": name})


async def workers_adapters(client: httpx.AsyncClient, model: str) -> list[list[str]]:
    """Each live worker's adapters, as its registry entry lists them."""
    overview = (await client.get("/v1/fleet")).json()
    return [w["adapters"] for w in overview["workers"] if w["model"] == model]


async def first_token(client: httpx.AsyncClient, job_id: str) -> None:
    """Returns once the job's stream holds a token: it runs."""
    async with aconnect_sse(client, "GET", f"/v1/jobs/{job_id}/events") as source:
        async for sse in source.aiter_sse():
            assert sse.event not in ("done", "error"), sse.data
            if sse.event == "token":
                return


async def test_an_adapter_loaded_over_http_serves_at_once_on_every_worker_and_one_started_later(
    fleet: Fleet, admin: httpx.AsyncClient, model_name: str, sql: Path
) -> None:
    name, reference = f"{model_name}-sql", f"{model_name}-ref"
    fleet.start_worker(reference, "--lora", f"{reference}-sql={sql}")
    port = free_port()
    first = [fleet.start_worker(model_name, "--metrics-port", str(port)), fleet.start_worker(model_name)]
    expected = await job_tokens(admin, f"{reference}-sql")
    base = await job_tokens(admin, model_name)

    loaded = await load(admin, model_name, name, sql)

    assert loaded.status_code == 200, loaded.text
    assert loaded.text.startswith(f"Success: LoRA adapter '{name}' added") and "2 worker(s)" in loaded.text
    metrics = (await admin.get(f"http://127.0.0.1:{port}/metrics")).text  # its series, before its first job
    assert value(metrics, "ortfleet_adapter_requests_total", adapter=name) == 0, metrics
    assert value(metrics, "ortfleet_adapter_generation_tokens_total", adapter=name) == 0
    assert await job_tokens(admin, name) == expected != base
    listed = {m["id"]: m for m in (await admin.get("/v1/models")).json()["data"]}
    assert listed[name]["parent"] == model_name and listed[name]["root"] == str(sql)
    assert await workers_adapters(admin, model_name) == [[name], [name]]
    again = await load(admin, model_name, name, sql)
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]

    fleet.start_worker(model_name)  # its start-time check accounts for the loaded adapter, and it loads it
    for worker in first:
        worker.terminate()
    assert await workers_adapters(admin, model_name) == [[name]]
    assert await job_tokens(admin, name) == expected


async def test_an_unloaded_adapter_is_404_to_new_requests_its_running_job_ends_and_a_queued_one_fails(
    fleet: Fleet, admin: httpx.AsyncClient, model_name: str, sql: Path
) -> None:
    name = f"{model_name}-sql"
    fleet.start_worker(model_name, "--max-batch-size", "1", env={"ORTFLEET_STEP_DELAY_S": "0.02"})
    assert (await load(admin, None, name, sql)).status_code == 200  # the only model: named by default
    body = {
        "model": name,
        "prompt": "Once upon a time",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    running = await submit(admin, body)
    await first_token(admin, running["id"])
    queued = await submit(admin, {**body, "max_tokens": 4})

    unloaded = await unload(admin, model_name, name)

    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text.startswith(f"Success: LoRA adapter '{name}' removed")
    refused = await admin.post("/v1/jobs", json=body)
    assert refused.status_code == 404 and name in refused.json()["error"]["message"]
    assert name not in {m["id"] for m in (await admin.get("/v1/models")).json()["data"]}
    ended = await wait_done(admin, running["id"])
    assert ended["status"] == "succeeded" and ended["usage"]["completion_tokens"] == 40
    failed = await wait_done(admin, queued["id"])
    assert failed["status"] == "failed" and f"'{name}' was unloaded" in failed["error"], failed
    assert await workers_adapters(admin, model_name) == [[]]
    gone = await unload(admin, model_name, name)
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


async def test_an_adapter_that_does_not_fit_is_refused_naming_the_mismatch_and_no_worker_keeps_it(
    fleet: Fleet, admin: httpx.AsyncClient, model_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    wrong = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 7), np.float32)}
    misfit = write_adapter(tmp_path / "misfit", tiny_model, tensors=wrong)
    workers = [fleet.start_worker(model_name), fleet.start_worker(model_name)]

    refused = await load(admin, model_name, f"{model_name}-misfit", misfit)

    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "adapter_refused" and error["param"] == "lora_path"
    for part in ("q_proj", "[4, 7]", "no worker", model_name):
        assert part in error["message"]
    assert await workers_adapters(admin, model_name) == [[], []]
    job = await admin.post("/v1/jobs", json={"model": f"{model_name}-misfit", "prompt": "x"})
    assert job.status_code == 404
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "adapter_config.json").write_text("top secret words")
    unreadable = await load(admin, model_name, f"{model_name}-secret", tmp_path / "secret")
    assert unreadable.status_code == 400 and "secret words" not in unreadable.text
    unknown = await load(admin, f"{model_name}-nowhere", "x", misfit)
    assert unknown.status_code == 404
    for worker in workers:
        worker.terminate()
    nobody = await load(admin, model_name, f"{model_name}-late", misfit)
    assert nobody.status_code == 503 and nobody.json()["error"]["code"] == "no_live_worker"


async def test_with_api_keys_on_only_the_admin_key_loads_and_a_clients_key_gets_403_naming_it(
    fleet: Fleet, model_name: str, sql: Path
) -> None:
    keys = {"ORTFLEET_API_KEYS": f"alice:{ALICE}", "ORTFLEET_ADMIN_API_KEY": ADMIN}
    _, url = fleet.start_gateway(env={**ENABLED, **keys})
    fleet.start_worker(model_name)
    name = f"{model_name}-sql"
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        plain = await load(client, model_name, name, sql, authorization=f"Bearer {ALICE}")
        nobody = await load(client, model_name, name, sql)
        admin = await load(client, model_name, name, sql, authorization=f"Bearer {ADMIN}")
        job = await client.post(
            "/v1/jobs",
            json={"model": name, "prompt": "x", "max_tokens": 2},
            headers={"authorization": f"Bearer {ALICE}"},
        )

    assert plain.status_code == 403
    assert "ORTFLEET_ADMIN_API_KEY" in plain.json()["error"]["message"] and "'alice'" in plain.text
    assert nobody.status_code == 401
    assert admin.status_code == 200, admin.text
    assert job.status_code == 202, job.text


async def test_with_runtime_loading_off_the_routes_answer_404_naming_the_setting(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str, sql: Path
) -> None:
    fleet.start_worker(model_name)

    for answer in (await load(client, model_name, "x", sql), await unload(client, model_name, "x")):
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["code"] == "runtime_lora_updating_disabled"
        assert "ORTFLEET_ALLOW_RUNTIME_LORA_UPDATING" in error["message"]


async def test_a_load_into_a_fleet_with_a_worker_whose_engine_serves_no_adapters_is_refused_naming_it(
    fleet: Fleet, admin: httpx.AsyncClient, model_name: str, sql: Path
) -> None:
    fleet.start_worker(model_name, "--fake-engine", "1:4")

    refused = await load(admin, model_name, f"{model_name}-sql", sql)

    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "only by ortfleet's batcher" in message and "a fake engine" in message
    assert await workers_adapters(admin, model_name) == [[]]


async def test_a_paged_worker_loads_and_unloads_an_adapter_over_http_as_a_batcher_worker_does(
    fleet: Fleet, admin: httpx.AsyncClient, model_name: str, sql: Path
) -> None:
    name, reference = f"{model_name}-sql", f"{model_name}-ref"
    fleet.start_worker(reference, "--lora", f"{reference}-sql={sql}")  # the batcher's tokens
    fleet.start_worker(model_name, env={"ORTFLEET_SCHEDULER": "paged"})
    expected = await job_tokens(admin, f"{reference}-sql")
    base = await job_tokens(admin, model_name)

    loaded = await load(admin, model_name, name, sql)

    assert loaded.status_code == 200, loaded.text
    assert await job_tokens(admin, name) == expected != base
    assert await workers_adapters(admin, model_name) == [[name]]
    assert (await unload(admin, model_name, name)).status_code == 200
    body = {"model": name, "prompt": "Once upon a time", "max_tokens": 4}
    assert (await admin.post("/v1/completions", json=body)).status_code == 404
    assert await job_tokens(admin, model_name) == base
