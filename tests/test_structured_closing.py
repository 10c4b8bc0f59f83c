"""Structured output that closes within max_tokens, on real workers: where max_tokens would cut a JSON
schema answer, a JSON object, a tool call's arguments or a Responses text format, the worker ends the
document early so that it parses and validates, says `closed_early`, and finishes with `stop`; `close_early:
false` gives the cut text; a budget too small for any document is a 400 naming the fewest tokens; an
answer that ends on its own is unchanged. The tiny model's output is random: it rambles until stopped."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from redis.asyncio import Redis

from common.registry import live_workers
from ortfleet.bench import structured_cases as bench
from tests.conftest import Fleet, keys
from tests.jobs_client import read_events, streamed_text, submit, wait_done
from tests.test_observability import value
from tests.test_reliability import kill_while_streaming

pytestmark = pytest.mark.module_fleet  # one gateway and one served worker for the module's tests

OPEN = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
NESTED = {
    "type": "object",
    "properties": {
        "order": {
            "type": "object",
            "properties": {
                "customer": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                    "required": ["name", "vip"],
                },
                "lines": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"enum": ["a-1", "b-2"]}, "count": {"type": "integer"}},
                        "required": ["sku", "count"],
                    },
                    "minItems": 2,
                },
            },
            "required": ["customer", "lines"],
        },
        "total": {"type": "number"},
    },
    "required": ["order", "total"],
}
BOUNDED = {  # a document the model cannot make longer than about 30 tokens: it ends on its own
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "pet"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["query", "limit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}]


class Note(BaseModel):
    title: str
    body: str
    stars: int


def chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


async def fewest_tokens(client: httpx.AsyncClient, served: str, schema: dict[str, Any]) -> int:
    """The fewest tokens of a document of `schema`, as the 400 for max_tokens 1 names them."""
    body = {
        "model": served,
        "messages": chat("Go."),
        "max_tokens": 1,
        "response_format": schema_format(schema),
    }
    reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "max_tokens_too_small" and error["param"] == "max_tokens"
    found = re.search(r"takes (\d+) tokens", error["message"])
    assert found is not None, error["message"]
    return int(found.group(1))


async def test_a_json_schema_answer_max_tokens_would_cut_parses_with_the_sdk_and_says_closed_early(
    sdk: openai.OpenAI, served: str
) -> None:
    for temperature in (0.0, 1.0):
        parsed = sdk.chat.completions.parse(
            model=served,
            messages=chat("A note."),
            response_format=Note,
            max_tokens=40,
            temperature=temperature,
        )
        choice = parsed.choices[0]
        assert isinstance(choice.message.parsed, Note)
        assert choice.finish_reason == "stop" and (choice.model_extra or {}).get("closed_early") is True
        assert parsed.usage is not None and parsed.usage.completion_tokens <= 40
    with pytest.raises(openai.LengthFinishReasonError):  # today's behaviour, asked for
        sdk.chat.completions.parse(
            model=served,
            messages=chat("A note."),
            response_format=Note,
            max_tokens=40,
            temperature=0,
            extra_body={"close_early": False},
        )


async def test_a_json_object_answer_max_tokens_would_cut_is_one_whole_object(
    sdk: openai.OpenAI, served: str
) -> None:
    for max_tokens in (8, 20, 60):
        completion = sdk.chat.completions.create(
            model=served,
            messages=chat("JSON please."),
            response_format={"type": "json_object"},
            max_tokens=max_tokens,
            temperature=0,
        )
        choice = completion.choices[0]
        assert isinstance(json.loads(choice.message.content or ""), dict)
        assert choice.finish_reason == "stop" and (choice.model_extra or {}).get("closed_early") is True
        text = sdk.completions.create(
            model=served,
            prompt="{",
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"response_format": {"type": "json_object"}},
        ).choices[0]
        assert isinstance(json.loads(text.text), dict) and text.finish_reason == "stop"
        assert (text.model_extra or {}).get("closed_early") is True


async def test_a_tool_calls_arguments_are_closed_early_and_follow_the_tools_schema(
    sdk: openai.OpenAI, served: str
) -> None:
    for tool_choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        completion = sdk.chat.completions.create(
            model=served,
            messages=chat("Look it up."),
            tools=TOOLS,
            tool_choice=tool_choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_tokens=90,  # the shortest call takes 69 of the tiny model's tokens
            temperature=0,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and (choice.model_extra or {}).get("closed_early") is True
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1 and calls[0].function.name == "lookup"
        jsonschema.validate(json.loads(calls[0].function.arguments), LOOKUP)


async def test_a_responses_text_format_answer_is_closed_early_and_completed(
    sdk: openai.OpenAI, served: str
) -> None:
    text_format: Any = {"format": {"type": "json_schema", "name": "note", "schema": OPEN}}
    response = sdk.responses.create(
        model=served, input="A note.", text=text_format, max_output_tokens=20, temperature=0
    )
    assert response.status == "completed" and response.incomplete_details is None
    jsonschema.validate(json.loads(response.output_text), OPEN)
    assert (response.model_extra or {}).get("closed_early") is True
    with sdk.responses.create(
        model=served, input="A note.", text=text_format, max_output_tokens=20, temperature=0, stream=True
    ) as events:
        final = [event for event in events if event.type in ("response.completed", "response.incomplete")]
    [completed] = final
    assert completed.type == "response.completed"
    assert completed.response.output_text == response.output_text
    assert (completed.response.model_extra or {}).get("closed_early") is True
    cut = sdk.responses.create(
        model=served,
        input="A note.",
        text=text_format,
        max_output_tokens=20,
        temperature=0,
        extra_body={"close_early": False},
    )
    assert cut.status == "incomplete" and "closed_early" not in (cut.model_extra or {})


async def test_a_schema_whose_shortest_document_is_long_closes_within_a_budget_of_just_that(
    client: httpx.AsyncClient, served: str
) -> None:
    fewest = await fewest_tokens(client, served, NESTED)
    assert fewest > 20  # nested required objects and a minItems array of them
    for max_tokens in (fewest, fewest + 3, fewest + 30):
        job = await submit(
            client,
            {
                "model": served,
                "prompt": "Order:",
                "max_tokens": max_tokens,
                "response_format": schema_format(NESTED),
            },
        )
        done = await wait_done(client, job["id"])
        assert done["status"] == "succeeded" and done["finish_reason"] == "stop", done
        jsonschema.validate(json.loads(done["output"]), NESTED)
        assert done["closed_early"] is True and done["usage"]["completion_tokens"] <= max_tokens


EMAIL = {"type": "object", "properties": {"to": {"type": "string", "format": "email"}}, "required": ["to"]}
URI = {"type": "object", "properties": {"home": {"type": "string", "format": "uri"}}, "required": ["home"]}
KEYED = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}


async def test_formats_whose_first_choice_loops_and_a_list_regex_close_too(
    client: httpx.AsyncClient, served: str
) -> None:
    """An e-mail address, a URI and a regex list whose separator comes before its end: each closes
    within its budget, where the walk once went round in its loop and nothing was closed."""
    for schema, field, looks_right in ((EMAIL, "to", r"[^@]+@[^@]+"), (URI, "home", r"[A-Za-z][^:]*:.*")):
        fewest = await fewest_tokens(client, served, schema)
        # greedy: a sampled answer of the tiny random model may close its address by itself within the
        # budget, leaving the closer nothing to do
        body = {"model": served, "messages": chat("Go."), "max_tokens": fewest + 4, "temperature": 0}
        reply = await client.post(
            "/v1/chat/completions", json={**body, "response_format": schema_format(schema)}
        )
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice.get("closed_early") is True, choice
        assert re.fullmatch(looks_right, json.loads(choice["message"]["content"])[field])
    pattern = r"[a-z]+(,[a-z]+)*\."
    job = await submit(
        client,
        {
            "model": served,
            "prompt": "Words:",
            "max_tokens": 12,
            "response_format": {"type": "regex", "regex": pattern},
        },
    )
    done = await wait_done(client, job["id"])
    assert done["status"] == "succeeded" and done["finish_reason"] == "stop", done
    assert re.fullmatch(pattern, done["output"]) and done["usage"]["completion_tokens"] <= 12


async def test_an_object_closed_at_its_fewest_tokens_has_no_key_twice(
    client: httpx.AsyncClient, served: str
) -> None:
    fewest = await fewest_tokens(client, served, KEYED)
    body = {"model": served, "messages": chat("Go."), "max_tokens": fewest}
    reply = await client.post("/v1/chat/completions", json={**body, "response_format": schema_format(KEYED)})
    assert reply.status_code == 200, reply.text
    pairs = json.loads(reply.json()["choices"][0]["message"]["content"], object_pairs_hook=list)
    assert len(pairs) >= 3 and len({key for key, _ in pairs}) == len(pairs), pairs
    jsonschema.validate(dict(pairs), KEYED)


async def test_a_format_no_ending_is_found_for_comes_back_cut_saying_closing_was_off(
    client: httpx.AsyncClient, served: str
) -> None:
    """A regex longer than the walk may write: the answer is cut at max_tokens, and says `closed_early:
    false` on the choice, the stream's last chunk and the job, where a closed or untouched one says
    true or nothing."""
    far = {"type": "regex", "regex": "[~|]{5000}"}
    body = {"model": served, "messages": chat("Go."), "max_tokens": 6, "response_format": far}
    reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["closed_early"] is False, choice
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        chunks = [json.loads(line[6:]) async for line in streamed.aiter_lines() if line[6:].startswith("{")]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["closed_early"] is False, last
    job = await submit(client, {"model": served, "prompt": "Go:", "max_tokens": 6, "response_format": far})
    done = await wait_done(client, job["id"])
    assert done["finish_reason"] == "length" and done["closed_early"] is False, done
    cut = await submit(
        client,
        {"model": served, "prompt": "Go:", "max_tokens": 6, "response_format": far, "close_early": False},
    )
    assert (await wait_done(client, cut["id"]))["closed_early"] is None  # not asked for: nothing to say


async def test_a_budget_too_small_for_any_document_is_a_bad_request_naming_the_fewest_tokens(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    fewest = await fewest_tokens(client, served, OPEN)  # proven the fewest: a refusal right below it
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.responses.create(
            model=served,
            input="Note:",
            text={"format": {"type": "json_schema", "name": "note", "schema": OPEN}},
            max_output_tokens=fewest - 1,
        )
    assert raised.value.code == "max_tokens_too_small"
    assert f"shortest document of its response format found takes {fewest} tokens" in raised.value.message
    assert (raised.value.body or {}).get("param") == "max_output_tokens"  # type: ignore[union-attr]
    job = await submit(
        client, {"model": served, "prompt": "x", "max_tokens": 2, "response_format": schema_format(NESTED)}
    )
    failed = await wait_done(client, job["id"])
    assert failed["status"] == "failed" and failed["error_code"] == "max_tokens_too_small"
    cut = await submit(
        client,
        {
            "model": served,
            "prompt": "x",
            "max_tokens": 2,
            "close_early": False,
            "response_format": schema_format(NESTED),
        },
    )
    assert (await wait_done(client, cut["id"]))["finish_reason"] == "length"  # opted out: cut, as before


async def test_a_budget_a_document_may_fit_in_is_served_where_the_walk_found_only_longer_ones(
    client: httpx.AsyncClient, served: str
) -> None:
    """`a.` is a document of the list regex in two tokens, where the walk writes `t,t,t,t,t.`: max_tokens 6
    is served and closed, not refused. NESTED's shortest document is not proven: a budget below the one
    found, but above what the search proved, runs rather than being refused; far below it is refused,
    saying what was proven."""
    pattern = r"[a-z]+(,[a-z]+)*\."
    body = {"model": served, "messages": chat("Words."), "max_tokens": 6}
    reply = await client.post("/v1/chat/completions", json={**body, "guided_regex": pattern})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and re.fullmatch(pattern, choice["message"]["content"]), choice
    assert reply.json()["usage"]["completion_tokens"] <= 6
    found = await fewest_tokens(client, served, NESTED)
    ran = await client.post(
        "/v1/chat/completions",
        json={**body, "max_tokens": found - 1, "response_format": schema_format(NESTED)},
    )
    assert ran.status_code == 200, ran.text  # unproven: it runs (closed if the model leaves room, else cut)
    refused = await client.post(
        "/v1/chat/completions", json={**body, "max_tokens": 3, "response_format": schema_format(NESTED)}
    )
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "no document of its response format fits in fewer than" in message and f"takes {found}" in message


async def test_a_costly_format_refused_again_and_again_is_started_once_by_its_worker(
    client: httpx.AsyncClient, redis: Redis, served: str
) -> None:
    """Issue 68: a format whose first ending costs the walk's whole budget, sent with a max_tokens too small
    for it by many requests at once: each is refused as before, and the worker computed the grammar's
    start once (ortfleet_grammar_starts_computed_total), the other requests waiting for that one."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "^[~|]{299}$"}},
        "required": ["a"],
    }
    [worker] = [w for w in await live_workers(redis, keys) if w["model"] == served]

    async def counted() -> tuple[float, float]:
        metrics = (await client.get(worker["metrics_url"])).text
        computed = value(metrics, "ortfleet_grammar_starts_computed_total", model=served)
        reused = value(metrics, "ortfleet_grammar_starts_reused_total", model=served)
        assert computed is not None and reused is not None, "the worker counts its grammar starts"
        return computed, reused

    before = await counted()
    body = {
        "model": served,
        "messages": chat("go"),
        "max_tokens": 1,
        "response_format": schema_format(schema),
    }
    replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(8)))
    errors = [reply.json()["error"] for reply in replies]
    assert all(reply.status_code == 400 for reply in replies), [reply.text for reply in replies]
    assert {error["code"] for error in errors} == {"max_tokens_too_small"}
    assert len({error["message"] for error in errors}) == 1 and "takes 307 tokens" in errors[0]["message"]
    computed, reused = await counted()
    assert (computed - before[0], reused - before[1]) == (1, 7)


async def test_with_close_early_false_the_cut_text_comes_back_as_before(
    client: httpx.AsyncClient, served: str
) -> None:
    body = {"model": served, "prompt": "Note:", "max_tokens": 12, "response_format": schema_format(OPEN)}
    cut = await wait_done(client, (await submit(client, {**body, "close_early": False}))["id"])
    assert cut["finish_reason"] == "length" and cut["closed_early"] is None
    with pytest.raises(ValueError):
        json.loads(cut["output"])
    closed = await wait_done(client, (await submit(client, body))["id"])
    assert closed["finish_reason"] == "stop" and closed["closed_early"] is True
    jsonschema.validate(json.loads(closed["output"]), OPEN)
    assert closed["output"] != cut["output"]


async def test_an_answer_that_ends_on_its_own_within_its_budget_is_token_for_token_unchanged(
    client: httpx.AsyncClient, served: str
) -> None:
    for temperature, seed in ((0.0, None), (1.0, 7), (1.0, 8)):
        body: dict[str, Any] = {
            "model": served,
            "prompt": "Pet:",
            "temperature": temperature,
            "seed": seed,
            "response_format": schema_format(BOUNDED),
        }
        plain = await wait_done(
            client, (await submit(client, {**body, "max_tokens": 100, "close_early": False}))["id"]
        )
        assert plain["finish_reason"] == "stop"
        written = plain["usage"]["completion_tokens"]
        plain_events = await read_events(client, plain["id"])
        # the same budget with the closer, and a budget of exactly the tokens the model wrote on its own
        for max_tokens in (100, written):
            job = await submit(client, {**body, "max_tokens": max_tokens})
            done = await wait_done(client, job["id"])
            assert done["output"] == plain["output"] and done["closed_early"] is None
            assert done["usage"]["completion_tokens"] == written
            events = await read_events(client, job["id"])
            assert token_ids(events) == token_ids(plain_events)


def token_ids(events: list[Any]) -> list[int]:
    return [t for e in events if e.event == "token" for t in e.data["token_ids"]]


async def test_the_closing_tokens_stream_like_any_others(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    stream = sdk.chat.completions.create(
        model=served,
        messages=chat("A note."),
        response_format={"type": "json_object"},
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert isinstance(json.loads(text), dict)
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop" and (last.model_extra or {}).get("closed_early") is True
    job = await submit(
        client, {"model": served, "prompt": "{", "max_tokens": 16, "response_format": {"type": "json_object"}}
    )
    done = await wait_done(client, job["id"])
    events = await read_events(client, job["id"])
    assert streamed_text(events) == done["output"] and isinstance(json.loads(done["output"]), dict)
    final = events[-1]
    assert final.event == "done" and final.data["closed_early"] == "true"


@pytest.mark.parametrize("kill_at", [12, 37])
async def test_a_job_resumed_after_its_worker_died_replays_to_the_same_closed_document(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str, kill_at: int
) -> None:
    # 40 tokens: the closer overrules the model in the last few; a kill at 37 falls among them
    body = {"model": model_name, "prompt": "{", "max_tokens": 40, "response_format": {"type": "json_object"}}
    slow = {"ORTFLEET_STEP_DELAY_S": "0.05", "ORTFLEET_HEARTBEAT_TTL_S": "2"}
    first = fleet.start_worker(model_name, env=slow)
    second = fleet.start_worker(model_name, env=slow)
    expected = await wait_done(client, (await submit(client, body))["id"])
    assert expected["closed_early"] is True
    job = await kill_while_streaming(client, body, first, second, kill_at)
    done = await wait_done(client, job["id"])
    assert done["attempts"] == 2 and done["resume_exact"] is True
    assert kill_at <= done["resumed_from"] < 40
    assert done["output"] == expected["output"] and done["closed_early"] is True
    assert isinstance(json.loads(done["output"]), dict)
    assert streamed_text(await read_events(client, job["id"])) == done["output"]


@pytest.mark.default_model
async def test_the_default_model_closes_schemas_objects_and_tool_calls_within_tight_budgets(
    smollm2: str,
) -> None:
    with openai.OpenAI(base_url=smollm2 + "/v1", api_key="unused", max_retries=0) as sdk:
        # its pancake ingredients run on ("typeOfIngredient1", "typeOfIngredient2", ...) past any budget
        for max_tokens in (40, 120):
            parsed = sdk.chat.completions.parse(
                model="smollm2",
                messages=chat("Give me a simple pancake recipe."),
                response_format=bench.Recipe,
                max_tokens=max_tokens,
                temperature=0,
            )
            assert isinstance(parsed.choices[0].message.parsed, bench.Recipe)
            assert (parsed.choices[0].model_extra or {}).get("closed_early") is True
        anything = sdk.chat.completions.create(
            model="smollm2",
            messages=chat("Describe the sun in a JSON object."),
            response_format={"type": "json_object"},
            max_tokens=20,
            temperature=0,
        )
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)
        for tool_choice in ("required", {"type": "function", "function": {"name": "weather"}}):
            called = sdk.chat.completions.create(
                model="smollm2",
                messages=chat("What is the weather like in Lisbon today?"),
                tools=bench.TOOLS,  # type: ignore[arg-type]
                tool_choice=tool_choice,  # type: ignore[arg-type]
                parallel_tool_calls=False,
                max_tokens=24,
                temperature=0,
            )
            [call] = called.choices[0].message.tool_calls or []
            function = call.function  # type: ignore[union-attr]
            bench.TOOL_ARGUMENTS[function.name].model_validate_json(function.arguments)


@pytest.mark.default_model
async def test_on_the_default_model_answers_that_end_on_their_own_are_unchanged(smollm2: str) -> None:
    with openai.OpenAI(base_url=smollm2 + "/v1", api_key="unused", max_retries=0) as sdk:
        compared = 0
        for schema, prompt in bench.PARSE_CASES:  # as the bench sends them: 9 of 10 end on their own
            try:
                plain = sdk.chat.completions.parse(
                    model="smollm2",
                    messages=chat(prompt),
                    response_format=schema,
                    max_tokens=120,
                    temperature=0,
                    extra_body={"close_early": False},
                ).choices[0]
            except openai.LengthFinishReasonError:
                continue
            closing = sdk.chat.completions.parse(
                model="smollm2", messages=chat(prompt), response_format=schema, max_tokens=120, temperature=0
            ).choices[0]
            compared += 1
            assert plain.finish_reason == closing.finish_reason == "stop"
            assert closing.message.content == plain.message.content
            assert "closed_early" not in (closing.model_extra or {})
        assert compared >= 8
