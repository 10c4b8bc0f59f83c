"""vLLM's sampling extensions and operational endpoints, on a real fleet."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Fleet
from tests.jobs_client import read_events, submit, wait_done

pytestmark = pytest.mark.module_fleet  # one gateway and one served worker for the module's tests


async def greedy_tokens(client: httpx.AsyncClient, model: str, prompt: str, n: int) -> tuple[str, list[int]]:
    job = await submit(client, {"model": model, "prompt": prompt, "max_tokens": n})
    events = await read_events(client, job["id"])
    ids = [i for e in events if e.event == "token" for i in e.data.get("token_ids", [])]
    text = "".join(e.data.get("text", "") for e in events if e.event == "token")
    return text, ids


async def test_stop_token_ids_end_the_text_at_the_first_such_token(
    client: httpx.AsyncClient, served: str
) -> None:
    text, ids = await greedy_tokens(client, served, "Once upon a time", 24)
    stop_at = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])
    job = await submit(
        client,
        {"model": served, "prompt": "Once upon a time", "max_tokens": 24, "stop_token_ids": [ids[stop_at]]},
    )
    done = await wait_done(client, job["id"])
    assert done["finish_reason"] == "stop"
    assert done["usage"]["completion_tokens"] == stop_at + 1
    assert text.startswith(done["output"]) and len(done["output"]) < len(text)


async def test_include_stop_str_in_output_keeps_the_stop_string(sdk: openai.OpenAI, served: str) -> None:
    request: dict[str, Any] = {
        "model": served,
        "prompt": "Once upon a time",
        "max_tokens": 40,
        "temperature": 0,
    }
    free = sdk.completions.create(**request).choices[0].text
    stop = free[6:9]
    first = free.find(stop)
    kept = sdk.completions.create(**request, stop=stop, extra_body={"include_stop_str_in_output": True})
    dropped = sdk.completions.create(**request, stop=stop)
    assert kept.choices[0].text == free[: first + len(stop)]
    assert dropped.choices[0].text == free[:first]


async def test_repetition_penalty_changes_greedy_output_and_is_validated(
    sdk: openai.OpenAI, served: str
) -> None:
    request: dict[str, Any] = {
        "model": served,
        "prompt": "One, two, three,",
        "max_tokens": 40,
        "temperature": 0,
    }
    plain = sdk.completions.create(**request).choices[0].text
    penalised = sdk.completions.create(**request, extra_body={"repetition_penalty": 1.9}).choices[0].text
    assert penalised != plain
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.completions.create(**request, extra_body={"repetition_penalty": 0})
    assert raised.value.param == "repetition_penalty"


async def test_min_tokens_above_max_tokens_is_a_bad_request_naming_it(
    sdk: openai.OpenAI, served: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.completions.create(model=served, prompt="Hi", max_tokens=4, extra_body={"min_tokens": 9})
    assert raised.value.param == "min_tokens"


async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    sdk: openai.OpenAI, served: str
) -> None:
    stream = sdk.chat.completions.create(
        model=served,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    chunks = list(stream)
    texts = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert texts and all(c.usage is not None for c in texts)
    counts = [c.usage.completion_tokens for c in texts if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] <= 12
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in texts)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


async def test_health_version_and_the_model_entry_look_like_vllms(
    client: httpx.AsyncClient, served: str
) -> None:
    health = await client.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert (await client.get("/version")).json()["version"]
    model = (await client.get(f"/v1/models/{served}")).json()
    assert model["root"] == served and model["max_model_len"] == model["context_length"] > 0


async def test_health_is_unavailable_without_a_live_worker(own_fleet: Fleet) -> None:
    async with httpx.AsyncClient(base_url=own_fleet.gateway_url, timeout=30) as client:
        assert (await client.get("/health")).status_code == 503


async def test_tokenize_and_detokenize_are_answered_by_a_worker_of_the_model(
    client: httpx.AsyncClient, served: str
) -> None:
    tokens = (await client.post("/tokenize", json={"model": served, "prompt": "Hello there"})).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    job = await wait_done(
        client, (await submit(client, {"model": served, "prompt": "Hello there", "max_tokens": 1}))["id"]
    )
    assert tokens["count"] == job["usage"]["prompt_tokens"]  # the same ids the worker generates from
    back = (await client.post("/detokenize", json={"model": served, "tokens": tokens["tokens"]})).json()
    assert back["prompt"].strip() == "Hello there"
    chat = await client.post(
        "/tokenize", json={"model": served, "messages": [{"role": "user", "content": "Hi"}]}
    )
    chat_job = await submit(
        client, {"model": served, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    )
    assert chat.json()["count"] == (await wait_done(client, chat_job["id"]))["usage"]["prompt_tokens"]
    missing = await client.post("/tokenize", json={"model": "no-such-model", "prompt": "x"})
    assert missing.status_code == 404
    neither = await client.post("/tokenize", json={"model": served})
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("bad", [-1, 320, 10**6, 2**40])
async def test_detokenize_refuses_an_id_outside_the_vocabulary_naming_it(
    client: httpx.AsyncClient, served: str, bad: int
) -> None:
    """The tiny model's vocabulary is ids 0..319."""
    reply = await client.post("/detokenize", json={"model": served, "tokens": [5, 6, bad]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "tokens.2" and error["type"] == "invalid_request_error"
    assert f": {bad} is not a token id" in error["message"] and "0 to 319" in error["message"]
    last = await client.post("/detokenize", json={"model": served, "tokens": [5, 319]})
    assert last.status_code == 200 and "\ufffd" not in last.json()["prompt"]


async def test_tokenize_needs_a_key_on_a_keyed_gateway_and_health_does_not(
    fleet: Fleet, model_name: str
) -> None:
    key = "ofk_" + secrets.token_urlsafe(24)
    _, url = fleet.start_gateway(env={"ORTFLEET_API_KEYS": f"t-{model_name}:{key}"})
    fleet.start_worker(model_name)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.post("/tokenize", json={"prompt": "Hi", "model": model_name})).status_code == 401
        assert (await http.get("/health")).status_code == 200
        keyed = await http.post(
            "/tokenize",
            json={"prompt": "Hi", "model": model_name},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert keyed.status_code == 200 and keyed.json()["count"] > 0


@pytest.mark.default_model
async def test_ignore_eos_and_min_tokens_generate_past_the_end_of_sequence(smollm2: str) -> None:
    request: dict[str, Any] = {
        "model": "smollm2",
        "prompt": "The capital of France is",
        "max_tokens": 100,
        "temperature": 0,
    }
    with openai.OpenAI(base_url=smollm2 + "/v1", api_key="unused", max_retries=0) as sdk:
        free = sdk.completions.create(**request)
        assert free.choices[0].finish_reason == "stop" and free.usage is not None
        ends_at = free.usage.completion_tokens
        assert ends_at < 100  # the model ends by itself
        exact = sdk.completions.create(**request, extra_body={"ignore_eos": True})
        assert exact.usage is not None and exact.usage.completion_tokens == 100
        assert exact.choices[0].finish_reason == "length"
        at_least = sdk.completions.create(**request, extra_body={"min_tokens": ends_at + 5})
        assert at_least.usage is not None and at_least.usage.completion_tokens >= ends_at + 5
