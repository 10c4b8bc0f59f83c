"""API keys carry a priority class ceiling and a fair-share weight: from the environment or the keys
file, enforced by the gateways and shared by all of them."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from common.apikeys import ApiKeyError, parse_env_keys
from tests.conftest import Fleet, keys
from tests.jobs_client import submit as submit_http
from tests.jobs_client import wait_done
from tests.test_security import bearer, create_key


@pytest.mark.unit
def test_env_keys_carry_a_weight_and_a_class_ceiling() -> None:
    token = "k" * 20
    [plain, weighted] = parse_env_keys(f"a:{token},b:{token}:3:batch")

    assert (plain.weight, plain.max_class) == (1.0, "interactive")
    assert (weighted.weight, weighted.max_class) == (3.0, "batch")
    with pytest.raises(ApiKeyError, match="weight"):
        parse_env_keys(f"c:{token}:0")
    with pytest.raises(ApiKeyError, match="max class"):
        parse_env_keys(f"c:{token}:1:urgent")


async def test_a_key_limited_to_batch_cannot_submit_interactive_jobs(
    fleet: Fleet, tmp_path: Path, redis: Redis, model_name: str
) -> None:
    key_file = tmp_path / "keys.json"
    name = f"bulk-{secrets.token_hex(3)}"
    token = create_key(key_file, name, "--max-class", "batch", "--weight", "2.5")
    _, url = fleet.start_gateway(env={"ORTFLEET_API_KEYS_FILE": str(key_file)})
    fleet.start_worker(model_name)
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(token)) as client:
        refused = await client.post("/v1/jobs", json=body)
        chat = await client.post(
            "/v1/chat/completions",
            json={**body, "messages": [{"role": "user", "content": "Hi"}], "prompt": None},
        )
        job = await submit_http(client, {**body, "priority": "batch"})
        done = await wait_done(client, job["id"])

    assert refused.status_code == 403 and refused.json()["error"]["param"] == "priority"
    assert chat.status_code == 403
    assert done["status"] == "succeeded" and done["priority"] == "batch"
    record = await redis.hgetall(keys.job(job["id"]))  # type: ignore[misc]
    assert record["weight"] == "2.5" and record["owner"] == name


async def test_weights_from_the_keys_file_share_a_model_across_two_gateways(
    fleet: Fleet, tmp_path: Path, redis: Redis, model_name: str
) -> None:
    key_file = tmp_path / "keys.json"
    suffix = secrets.token_hex(3)
    heavy = create_key(key_file, f"heavy-{suffix}", "--weight", "3")
    light = create_key(key_file, f"light-{suffix}")
    env = {"ORTFLEET_API_KEYS_FILE": str(key_file)}
    _, first_url = fleet.start_gateway(env=env)
    _, second_url = fleet.start_gateway(env=env)
    worker = fleet.start_worker(model_name)
    worker.pause()
    try:
        body = {"model": model_name, "prompt": "Hi", "max_tokens": 2, "priority": "batch"}
        async with (
            httpx.AsyncClient(base_url=first_url, timeout=30, headers=bearer(heavy)) as one,
            httpx.AsyncClient(base_url=second_url, timeout=30, headers=bearer(light)) as two,
        ):
            ids = [(await submit_http(one, body))["id"] for _ in range(12)]
            ids += [(await submit_http(two, body))["id"] for _ in range(12)]
            position = (await two.get(f"/v1/jobs/{ids[12]}")).json()["queue_position"]
    finally:
        worker.resume()
    started = {}
    for job_id, token in [(i, heavy) for i in ids[:12]] + [(i, light) for i in ids[12:]]:
        async with httpx.AsyncClient(base_url=first_url, timeout=30, headers=bearer(token)) as client:
            started[job_id] = (await wait_done(client, job_id))["created_at"]
        record = await redis.hgetall(keys.job(job_id))  # type: ignore[misc]
        started[job_id] = float(record["started_at"])
    order = sorted(ids, key=started.__getitem__)
    assert position == 1  # the light key's first job waits only behind the heavy key's first
    assert sum(1 for job_id in order[:8] if job_id in ids[:12]) == 6  # 3:1 among the first eight
