"""Cache scopes: a request reuses the cached prompt prefixes of its own API key's requests only (or of the
keys an operator groups, or of the whole fleet), and of those only with an equal cache_salt; no key
evicts another's prefixes while it holds more of the cache. Real gateways and workers on the tiny model,
with two API keys."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from common.gateway_settings import GatewaySettings
from common.jobs.payload import job_payload, parse_job_payload
from common.prefix_hints import hint_keys
from common.wire import ChatMessage, JobSpec, Sampling
from common.worker_settings import WorkerSettings
from gateway.cache_scope import cache_scope
from tests.conftest import Fleet, keys
from tests.jobs_client import submit, wait_done
from tests.test_security import bearer, create_key
from worker.engines.ort_engine import engine_batching

STORY = " ".join(["one two three four five six seven eight"] * 11)  # about 300 tokens: two 128-token chunks
REUSED = 256  # the whole chunks of STORY short of its last token


def story(k: int | str) -> str:
    return f"Record {k}. {STORY}"


Tenants = tuple[dict[str, str], dict[str, str]]  # key names, their tokens
StartGateway = Callable[..., str]


@pytest.fixture
def tenants(tmp_path: Path) -> tuple[Path, Tenants]:
    """A keys file with two tenants' keys, alice and bob (names unique to the test: tenants are
    Redis-wide)."""
    key_file = tmp_path / "api-keys.json"
    suffix = secrets.token_hex(4)
    names = {who: f"{who}-{suffix}" for who in ("alice", "bob")}
    tokens = {who: create_key(key_file, name) for who, name in names.items()}
    return key_file, (names, tokens)


@pytest.fixture
def keyed_gateway(fleet: Fleet, tenants: tuple[Path, Tenants]) -> StartGateway:
    """Starts a gateway that requires the tenants' keys, with more settings; its URL."""
    key_file, _ = tenants

    def start(**env: str) -> str:
        _, url = fleet.start_gateway(env={"ORTFLEET_API_KEYS_FILE": str(key_file), **env})
        return url

    return start


def as_key(url: str, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=60, headers=bearer(token))


async def cached(client: httpx.AsyncClient, model: str, prompt: str, **extra: Any) -> int:
    """The prompt tokens a job of this prompt reused from the prefix cache."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    done = await wait_done(client, (await submit(client, body))["id"])
    assert done["status"] == "succeeded", done
    reused: int = done["usage"]["prompt_tokens_details"]["cached_tokens"]
    return reused


@pytest.mark.unit
def test_a_jobs_cache_scope_is_its_keys_unless_keys_are_grouped_or_the_fleet_is_one_scope() -> None:
    by_key = GatewaySettings()
    assert cache_scope(by_key, "alice", None) == cache_scope(by_key, "alice", None)
    assert cache_scope(by_key, "alice", None) != cache_scope(by_key, "bob", None)
    assert cache_scope(by_key, "alice", None) != cache_scope(by_key, "alice", "s")
    assert cache_scope(by_key, "alice", "s") != cache_scope(by_key, "alice", "t")
    grouped = GatewaySettings(prefix_cache_groups=[["alice", "bob"]])
    assert cache_scope(grouped, "alice", None) == cache_scope(grouped, "bob", None)
    assert cache_scope(grouped, "alice", None) != cache_scope(grouped, "carol", None)
    assert cache_scope(grouped, "alice", "s") != cache_scope(grouped, "bob", "t")
    fleet = GatewaySettings(prefix_cache_scope="fleet")
    assert cache_scope(fleet, "alice", None) == cache_scope(fleet, "carol", None)
    assert cache_scope(fleet, "alice", "s") != cache_scope(fleet, "carol", None)


@pytest.mark.unit
def test_a_key_in_two_cache_groups_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="'bob' is in more than one group"):
        GatewaySettings(prefix_cache_groups=[["alice", "bob"], ["bob"]])


@pytest.mark.unit
def test_a_jobs_cache_scope_travels_in_its_payload_for_every_attempt() -> None:
    spec = JobSpec(id="job_x", model="m", prompt="hi", sampling=Sampling(), submitted_at=0, cache_scope="ab")
    assert parse_job_payload(job_payload(spec, 0).decode()).cache_scope == "ab"


@pytest.mark.unit
def test_routing_hints_of_one_cache_scope_are_not_found_from_another() -> None:
    messages = [ChatMessage(role="user", content=STORY)]
    assert set(hint_keys("m", "alice", messages, keys)).isdisjoint(hint_keys("m", "bob", messages, keys))


@pytest.mark.module_fleet
async def test_another_keys_identical_prompt_reuses_nothing_of_a_keys_cached_prefix(
    fleet: Fleet, keyed_gateway: StartGateway, tenants: tuple[Path, Tenants], model_name: str
) -> None:
    _, (_, tokens) = tenants
    url = keyed_gateway()
    fleet.start_worker(model_name)
    async with as_key(url, tokens["alice"]) as alice, as_key(url, tokens["bob"]) as bob:
        assert await cached(alice, model_name, STORY) == 0
        assert await cached(bob, model_name, STORY + " nine") == 0  # alice's prompt KV is in the cache
        assert await cached(alice, model_name, STORY + " ten") == REUSED


@pytest.mark.module_fleet
async def test_keys_an_operator_groups_or_a_single_tenant_fleet_reuse_each_others_prefixes(
    fleet: Fleet, keyed_gateway: StartGateway, tenants: tuple[Path, Tenants], model_name: str
) -> None:
    _, (names, tokens) = tenants
    grouped = keyed_gateway(ORTFLEET_PREFIX_CACHE_GROUPS=f'[["{names["alice"]}", "{names["bob"]}"]]')
    one_scope = keyed_gateway(ORTFLEET_PREFIX_CACHE_SCOPE="fleet")
    fleet.start_worker(model_name)
    for k, url in enumerate((grouped, one_scope)):
        async with as_key(url, tokens["alice"]) as alice, as_key(url, tokens["bob"]) as bob:
            assert await cached(alice, model_name, story(k)) == 0
            assert await cached(bob, model_name, story(k)) == REUSED
            assert await cached(bob, model_name, story(k), cache_salt="bob's own") == 0


@pytest.mark.module_fleet
async def test_one_keys_requests_with_different_cache_salts_reuse_nothing_of_each_other_on_every_route(
    fleet: Fleet, keyed_gateway: StartGateway, tenants: tuple[Path, Tenants], model_name: str
) -> None:
    _, (_, tokens) = tenants
    url = keyed_gateway()
    fleet.start_worker(model_name)
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=tokens["alice"], max_retries=0)

    async def jobs(prompt: str, salt: str | None) -> int:
        async with as_key(url, tokens["alice"]) as alice:
            return await cached(alice, model_name, prompt, **({"cache_salt": salt} if salt else {}))

    async def chat(prompt: str, salt: str | None) -> int:
        reply = sdk.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt} if salt else None,
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    async def completions(prompt: str, salt: str | None) -> int:
        reply = sdk.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt} if salt else None,
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    async def responses(prompt: str, salt: str | None) -> int:
        reply = sdk.responses.create(
            model=model_name,
            input=prompt,
            max_output_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt} if salt else None,
        )
        assert reply.usage is not None
        return reply.usage.input_tokens_details.cached_tokens

    with sdk:
        for route in (jobs, chat, completions, responses):
            prompt = story(route.__name__)
            assert await route(prompt, "salt-one") == 0
            assert await route(prompt, "salt-two") == 0, route.__name__
            assert await route(prompt, None) == 0, route.__name__
            assert await route(prompt, "salt-one") > 0, route.__name__


@pytest.mark.module_fleet
async def test_a_key_filling_the_cache_evicts_its_own_prefixes_before_a_key_that_holds_fewer(
    fleet: Fleet, keyed_gateway: StartGateway, tenants: tuple[Path, Tenants], model_name: str
) -> None:
    _, (_, tokens) = tenants
    url = keyed_gateway()
    fleet.start_worker(model_name, env={"ORTFLEET_MAX_BATCH_SIZE": "2"})  # two slots: two prompts kept
    async with as_key(url, tokens["alice"]) as alice, as_key(url, tokens["bob"]) as bob:
        assert await cached(alice, model_name, story("alice")) == 0
        for k in range(4):  # more prompts than the cache holds, each as long as alice's
            assert await cached(bob, model_name, story(k)) == 0
        assert await cached(alice, model_name, story("alice")) == REUSED


@pytest.mark.module_fleet
async def test_an_empty_or_overlong_cache_salt_is_refused_naming_the_field(
    fleet: Fleet, keyed_gateway: StartGateway, tenants: tuple[Path, Tenants], model_name: str
) -> None:
    _, (_, tokens) = tenants
    url = keyed_gateway()
    fleet.start_worker(model_name)
    async with as_key(url, tokens["alice"]) as alice:
        for salt in ("", "s" * 257):
            for path, body, status in [
                ("/v1/jobs", {"prompt": "hi"}, 422),
                ("/v1/completions", {"prompt": "hi"}, 400),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400),
                ("/v1/responses", {"input": "hi"}, 400),
            ]:
                reply = await alice.post(path, json={"model": model_name, "cache_salt": salt, **body})
                assert reply.status_code == status, (path, reply.text)
                assert reply.json()["error"]["param"] == "cache_salt", (path, reply.text)
                assert "cache_salt" in reply.json()["error"]["message"]


def _paged_model(folder: Path, **batching: Any) -> Path:
    """A model folder whose genai_config gives og.Engine dynamic batching (paged attention)."""
    folder.mkdir()
    dynamic = {"block_size": 256, **batching}
    config = {"model": {"context_length": 4096}, "engine": {"dynamic_batching": dynamic}}
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.unit
def test_og_engines_own_prefix_cache_is_off_unless_every_request_may_share_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """og.Engine (paged models on GPUs) caches prefixes for every request alike: a worker turns it on
    only where the fleet is one cache scope, and never where the model's build turned it off."""
    paged = _paged_model(tmp_path / "paged")
    assert engine_batching(paged, None, None, prefix_caching=False) == {"prefix_caching": False}
    given_rows = engine_batching(paged, None, 32, prefix_caching=True)
    assert given_rows == {"max_batch_size": 32, "prefix_caching": True}
    windowed = _paged_model(tmp_path / "windowed", prefix_caching=False)
    assert engine_batching(windowed, None, None, prefix_caching=True) == {"prefix_caching": False}
    static = tmp_path / "static"
    static.mkdir()
    (static / "genai_config.json").write_text(json.dumps({"model": {}, "engine": {"static_batching": {}}}))
    assert engine_batching(static, None, None, prefix_caching=True) == {}

    # The worker asks for it only with ORTFLEET_PREFIX_CACHE_SCOPE=fleet (and its prefix cache on).
    monkeypatch.delenv("ORTFLEET_PREFIX_CACHE_SCOPE", raising=False)
    assert WorkerSettings().prefix_cache_scope == "key"
    monkeypatch.setenv("ORTFLEET_PREFIX_CACHE_SCOPE", "fleet")
    assert WorkerSettings().prefix_cache_scope == GatewaySettings().prefix_cache_scope == "fleet"
