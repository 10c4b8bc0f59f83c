"""A key's cost counts in tokens: its queued and running prompts against a limit of its own, its /tokenize
work against a budget, and a queued job's wait estimated from the tokens ahead of it."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.conftest import Fleet, Proc, RedisServer, keys
from tests.jobs_client import submit, wait_done
from tests.test_security import bearer, create_key

PROMPT_LIMIT = 200
PROMPT = "ab " * 150  # 113 tokens as the gateway estimates them (301 on the tiny model): one fits, two do not
TOKENIZE_RATE = 1000  # characters a second: 10,000 at once
STREAM_BYTES_LIMIT = 200_000  # one job of 60 tokens with 20 top logprobs (122,880 bytes) fits, two do not


@dataclass
class Keys:
    url: str
    strict_url: str  # a gateway whose jobs expire after 1 s in the queue
    model: str
    worker: Proc
    mallory: dict[str, str]
    alice: dict[str, str]
    mallory_name: str
    alice_name: str


@pytest.fixture(scope="module")
def two_keys(
    redis_server: RedisServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Keys]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.json"
    suffix = secrets.token_hex(4)
    mallory, alice = (create_key(key_file, f"{name}-{suffix}") for name in ("mallory", "alice"))
    env = {
        "ORTFLEET_API_KEYS_FILE": str(key_file),
        "ORTFLEET_KEY_MAX_PROMPT_TOKENS_IN_FLIGHT": str(PROMPT_LIMIT),
        "ORTFLEET_KEY_TOKENIZE_CHARS_PER_S": str(TOKENIZE_RATE),
        "ORTFLEET_KEY_MAX_STREAM_BYTES_IN_FLIGHT": str(STREAM_BYTES_LIMIT),
    }
    fleet = Fleet(redis_server.url, tiny_model)
    try:
        _, url = fleet.start_gateway(env=env)
        _, strict_url = fleet.start_gateway(env={**env, "ORTFLEET_QUEUE_TIMEOUT_S": "1"})
        model = "tiny-costs-" + suffix
        worker = fleet.start_worker(model)
        yield Keys(
            url,
            strict_url,
            model,
            worker,
            bearer(mallory),
            bearer(alice),
            f"mallory-{suffix}",
            f"alice-{suffix}",
        )
    finally:
        fleet.stop_all()


@pytest.fixture
async def mallory(two_keys: Keys) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=two_keys.url, headers=two_keys.mallory, timeout=30) as client:
        yield client


@pytest.fixture
async def alice(two_keys: Keys) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=two_keys.url, headers=two_keys.alice, timeout=30) as client:
        yield client


async def prompt_tokens_held(redis: Redis, key_name: str) -> int:
    return int(await redis.hget(keys.prompt_tokens_in_flight(key_name), ":total") or 0)  # type: ignore[misc]


async def test_a_key_past_its_prompt_tokens_in_flight_gets_429_while_another_key_is_served(
    two_keys: Keys, mallory: httpx.AsyncClient, alice: httpx.AsyncClient, redis: Redis
) -> None:
    body = {"model": two_keys.model, "prompt": PROMPT, "max_tokens": 2}
    two_keys.worker.pause()  # what is submitted stays queued
    try:
        first = await submit(mallory, body)
        refused = await mallory.post("/v1/jobs", json=body)
        other = await submit(alice, body)
        held = await prompt_tokens_held(redis, two_keys.mallory_name)
    finally:
        two_keys.worker.resume()

    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "too_many_prompt_tokens" and error["type"] == "rate_limit_error"
    assert f"limit of {PROMPT_LIMIT}" in error["message"]
    assert "ORTFLEET_KEY_MAX_PROMPT_TOKENS_IN_FLIGHT" in error["message"]
    assert held == 113
    answered = await wait_done(alice, other["id"])
    assert answered["status"] == "succeeded", (answered["error"], answered["error_code"])
    assert (await wait_done(mallory, first["id"]))["status"] == "succeeded"
    assert await prompt_tokens_held(redis, two_keys.mallory_name) == 0
    again = await submit(mallory, body)  # its prompt ended: the key may send another
    assert (await wait_done(mallory, again["id"]))["status"] == "succeeded"


async def stream_bytes_held(redis: Redis, key_name: str) -> int:
    return int(await redis.hget(keys.prompt_tokens_in_flight(key_name), ":bytes") or 0)  # type: ignore[misc]


async def test_a_key_whose_jobs_streams_would_keep_too_many_bytes_gets_429_while_another_key_is_served(
    two_keys: Keys, mallory: httpx.AsyncClient, alice: httpx.AsyncClient, redis: Redis
) -> None:
    with_logprobs = {"model": two_keys.model, "prompt": "Hi", "max_tokens": 60, "logprobs": 20}
    plain = {"model": two_keys.model, "prompt": "Hi", "max_tokens": 60}
    two_keys.worker.pause()  # what is submitted stays queued
    try:
        first = await submit(mallory, with_logprobs)
        refused = await mallory.post("/v1/jobs", json=with_logprobs)
        small = await submit(mallory, plain)  # 60 tokens without logprobs: 3,840 bytes, which fit
        held = await stream_bytes_held(redis, two_keys.mallory_name)
        other = await submit(alice, with_logprobs)
    finally:
        two_keys.worker.resume()

    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "too_many_stream_bytes" and error["type"] == "rate_limit_error"
    assert f"limit of {STREAM_BYTES_LIMIT}" in error["message"]
    assert "ORTFLEET_KEY_MAX_STREAM_BYTES_IN_FLIGHT" in error["message"]
    assert held == 60 * 2048 + 60 * 64
    for client, job in ((mallory, first), (mallory, small), (alice, other)):
        assert (await wait_done(client, job["id"]))["status"] == "succeeded"
    kept = await redis.memory_usage(keys.events(first["id"]))
    assert kept is not None and kept <= 60 * 2048, kept  # the estimate bounds what the stream keeps
    assert await stream_bytes_held(redis, two_keys.mallory_name) == 0
    assert not await redis.exists(keys.prompt_tokens_in_flight(two_keys.mallory_name))
    again = await submit(mallory, with_logprobs)  # its streams' jobs ended: the key may send another
    assert (await wait_done(mallory, again["id"]))["status"] == "succeeded"


async def test_the_prompt_tokens_in_flight_return_to_zero_however_jobs_end(
    two_keys: Keys, mallory: httpx.AsyncClient, redis: Redis
) -> None:
    name = two_keys.mallory_name
    small = {"model": two_keys.model, "prompt": "Hi", "max_tokens": 2}
    too_long = {"model": two_keys.model, "prompt": " ".join(str(i) for i in range(600)), "max_tokens": 2}
    two_keys.worker.pause()
    try:
        cancelled = await submit(mallory, small)
        held_queued = await prompt_tokens_held(redis, name)
        assert (await mallory.delete(f"/v1/jobs/{cancelled['id']}")).status_code == 200
        strict = httpx.AsyncClient(base_url=two_keys.strict_url, headers=two_keys.mallory, timeout=30)
        async with strict:
            expired = await wait_done(strict, (await submit(strict, small))["id"])
        held_while_paused = await prompt_tokens_held(redis, name)
    finally:
        two_keys.worker.resume()
    failure = await wait_done(mallory, (await submit(mallory, too_long))["id"])
    held_after_failure = await prompt_tokens_held(redis, name)
    done = await wait_done(mallory, (await submit(mallory, small))["id"])

    assert held_queued == 1  # "Hi": 2 characters, one token as estimated
    assert expired["error_code"] == "expired_in_queue"
    assert held_while_paused == 0  # the cancelled and the expired job gave theirs back
    assert failure["status"] == "failed" and failure["error_code"] == "context_length_exceeded"
    assert held_after_failure == 0
    assert done["status"] == "succeeded"
    assert await prompt_tokens_held(redis, name) == 0
    assert not await redis.exists(keys.prompt_tokens_in_flight(name))


async def test_a_key_past_its_tokenize_budget_gets_429_while_another_key_tokenizes(
    two_keys: Keys, mallory: httpx.AsyncClient, alice: httpx.AsyncClient
) -> None:
    prompt = {"model": two_keys.model, "prompt": "a b " * 5000}  # 20,000 characters: twice the burst

    first = await mallory.post("/tokenize", json=prompt)  # a full budget takes a call of any size
    again = await mallory.post("/tokenize", json=prompt)
    other = await alice.post("/tokenize", json=prompt)

    assert first.status_code == 200 and first.json()["count"] > 0
    assert again.status_code == 429, again.text
    assert again.json()["error"]["code"] == "tokenize_rate_exceeded"
    assert f"{TOKENIZE_RATE} characters per second" in again.json()["error"]["message"]
    assert 15 <= int(again.headers["Retry-After"]) <= 20  # until the first call's 20 s have passed
    assert other.status_code == 200
