"""What agents use of the Responses API, through the official `openai` SDK on one fleet per module: function
tools and their calls (whole and streamed), responses that continue stored ones on any gateway, structured
text, logprobs, input items a page at a time, deletion, and bad input named. The tiny model's output is
random: only the grammar makes its calls valid; the loop of call, result and answer runs on the default
model."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from common.events import done_entry, status_entry, token_entry
from common.wire import JobStatus
from gateway.responses.events import EventNumbering
from tests.conftest import Fleet, RedisServer
from tests.test_tools import TIME, WEATHER

PING = {"type": "object", "properties": {}, "additionalProperties": False}  # what no parameters mean
SCHEMAS = {"weather": WEATHER, "time": TIME, "ping": PING}
TOOLS: list[Any] = [
    {"type": "function", "name": "weather", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "time", "parameters": TIME},
]
# For `required` and `auto`, which show the model every tool: the tiny model's context is 512 tokens.
SMALL_TOOLS: list[Any] = [TOOLS[1], {"type": "function", "name": "ping"}]
MODEL = "tiny-responses-tools"
OG_MODEL = "tiny-responses-og-engine"


@pytest.fixture(scope="module")
def keys() -> tuple[str, str]:
    return "alice-" + secrets.token_hex(12), "bob-" + secrets.token_hex(12)


@pytest.fixture(scope="module")
def tools_fleet(redis_server: RedisServer, tiny_model: Path, keys: tuple[str, str]) -> Iterator[Fleet]:
    """Two gateways (a response continues on either) with two keys, a batcher worker and an og.Engine
    worker of the tiny model."""
    suffix = secrets.token_hex(4)  # tenants are Redis-wide
    env = {"ORTFLEET_API_KEYS": f"alice-{suffix}:{keys[0]},bob-{suffix}:{keys[1]}"}
    fleet = Fleet(redis_server.url, tiny_model, env=env)
    try:
        fleet.start_gateway()
        fleet.start_gateway()
        fleet.start_worker(MODEL)
        fleet.start_worker(OG_MODEL, "--scheduler", "og-engine")
        yield fleet
    finally:
        fleet.stop_all()


def client(fleet: Fleet, key: str, gateway: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(fleet.gateways[gateway].url) + "/v1", api_key=key, max_retries=0)


@pytest.fixture
def alice(tools_fleet: Fleet, keys: tuple[str, str]) -> Iterator[openai.OpenAI]:
    with client(tools_fleet, keys[0]) as sdk:
        yield sdk


def assert_valid_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.unit
def test_a_streamed_call_is_added_its_arguments_grow_and_it_is_done_with_the_same_ids() -> None:
    meta = {"id": "resp_x", "job_id": "job_x", "model": "m", "created_at": "0", "calls": "1"}
    numbering = EventNumbering(meta)
    text = '<tool_call>{"name":"time","arguments":{"zone":"UTC"}}</tool_call>'
    entries = [status_entry(JobStatus.running, prompt_tokens=3)]
    entries += [token_entry(text[i : i + 7], [i], i // 7) for i in range(0, len(text), 7)]
    entries.append(done_entry(JobStatus.succeeded, "stop", None))
    events = [event for fields in entries for event in numbering.entry(fields)]
    kinds = [event["type"] for event in events]
    assert "response.output_text.delta" not in kinds and "response.content_part.added" not in kinds
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"] == {
        "type": "function_call",
        "id": "fc_x_0",
        "call_id": "call_x_0",
        "name": "time",
        "arguments": "",
        "status": "in_progress",
    }
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert deltas == done["arguments"] == '{"zone":"UTC"}' and done["item_id"] == "fc_x_0"
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    [item] = events[-1]["response"]["output"]
    assert item == {**added["item"], "arguments": '{"zone":"UTC"}', "status": "completed"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def streamed_call(stream: Iterator[Any]) -> tuple[dict[str, Any], str, Any]:
    """The call item added, its arguments as streamed, and the final response."""
    added, arguments, final = None, "", None
    for event in stream:
        if event.type == "response.output_item.added" and event.item.type == "function_call":
            added = event.item.model_dump()
        elif event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        elif event.type == "response.function_call_arguments.done":
            assert event.arguments == arguments
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert added is not None and final is not None
    return added, arguments, final


async def test_a_named_or_required_call_follows_the_tools_schema_streamed_and_not(
    alice: openai.OpenAI,
) -> None:
    for tools, choice in ((TOOLS, {"type": "function", "name": "weather"}), (SMALL_TOOLS, "required")):
        response = alice.responses.create(
            model=MODEL,
            input="Weather?",
            tools=tools,
            tool_choice=choice,
            max_output_tokens=100,
            temperature=0,
        )
        assert response.status == "completed", response.output
        [call] = response.output
        assert call.type == "function_call" and call.status == "completed"
        assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
        assert_valid_call(call.name, call.arguments)
        if choice != "required":
            assert call.name == "weather"
        assert alice.responses.retrieve(response.id).output == response.output  # the same ids each time
        assert [(tool.type, tool.name) for tool in response.tools] == [("function", t["name"]) for t in tools]
    stream = alice.responses.create(
        model=MODEL,
        input="Time?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "time"},
        parallel_tool_calls=False,
        max_output_tokens=80,
        stream=True,
    )
    added, arguments, final = streamed_call(iter(stream))
    assert added["name"] == "time" and added["arguments"] == ""
    assert_valid_call("time", arguments)
    [item] = final.output
    assert item.call_id == added["call_id"] and item.arguments == arguments and item.status == "completed"


async def test_a_call_and_its_output_continue_a_stored_response_on_another_gateway(
    tools_fleet: Fleet, alice: openai.OpenAI, keys: tuple[str, str]
) -> None:
    named: Any = {"type": "function", "name": "time"}  # shows the model one tool: a short prompt
    first = alice.responses.create(
        model=MODEL, input="Time?", tools=TOOLS, tool_choice=named, max_output_tokens=80, temperature=0
    )
    [call] = first.output
    assert call.type == "function_call"
    with client(tools_fleet, keys[0], gateway=1) as other:
        answer = other.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}],
            tools=TOOLS,
            tool_choice=named,
            max_output_tokens=8,  # a cut call: the shortest whole one takes more of the tiny model's tokens
            temperature=0,
            extra_body={"close_early": False},
        )
        assert answer.previous_response_id == first.id
        items = other.responses.input_items.list(answer.id, order="asc")
        assert [item.type for item in items.data] == ["message", "function_call", "function_call_output"]
        listed = items.data[1]
        assert listed.type == "function_call" and (listed.id, listed.call_id) == (call.id, call.call_id)
    # the prompt held the first turn, its call and the call's output
    assert answer.usage is not None and first.usage is not None
    assert answer.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


async def test_input_items_come_a_page_at_a_time_and_a_deleted_response_is_gone(alice: openai.OpenAI) -> None:
    words = ["one", "two", "three", "four", "five"]
    response = alice.responses.create(
        model=MODEL, input=[{"role": "user", "content": word} for word in words], max_output_tokens=2
    )
    newest = alice.responses.input_items.list(response.id, limit=2)
    assert [item.content[0].text for item in newest.data] == ["five", "four"]  # type: ignore[union-attr]
    assert newest.has_more and newest.first_id == newest.data[0].id and newest.last_id == newest.data[1].id
    rest = alice.responses.input_items.list(response.id, limit=2, after=newest.last_id)
    assert [item.content[0].text for item in rest.data] == ["three", "two"]  # type: ignore[union-attr]
    every = list(alice.responses.input_items.list(response.id, order="asc", limit=2))  # the SDK pages on
    assert [item.content[0].text for item in every] == words  # type: ignore[union-attr]
    alice.responses.delete(response.id)
    for call in (alice.responses.retrieve, alice.responses.delete, alice.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            call(response.id)


async def test_another_keys_response_cannot_be_read_listed_deleted_or_continued(
    tools_fleet: Fleet, alice: openai.OpenAI, keys: tuple[str, str]
) -> None:
    response = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with client(tools_fleet, keys[1]) as bob:
        for call in (bob.responses.retrieve, bob.responses.delete, bob.responses.input_items.list):
            with pytest.raises(openai.NotFoundError):
                call(response.id)
        with pytest.raises(openai.NotFoundError) as raised:
            bob.responses.create(model=MODEL, input="Hi", previous_response_id=response.id)
        assert raised.value.param == "previous_response_id"  # type: ignore[attr-defined]
    assert alice.responses.retrieve(response.id).id == response.id


async def test_text_format_json_schema_gives_json_that_follows_the_schema(alice: openai.OpenAI) -> None:
    response = alice.responses.create(
        model=MODEL,
        input="Which zone?",
        text={"format": {"type": "json_schema", "name": "zone", "schema": TIME, "strict": True}},
        max_output_tokens=40,
        temperature=1,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), TIME)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


async def test_greedy_top_logprobs_give_each_token_as_its_own_likeliest(alice: openai.OpenAI) -> None:
    response = alice.responses.create(
        model=MODEL,
        input="Hi",
        max_output_tokens=5,
        temperature=0,
        top_logprobs=3,
        include=["message.output_text.logprobs"],
    )
    logprobs = response.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and len(logprobs) == 5 and response.top_logprobs == 3
    for entry in logprobs:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob
    streamed = alice.responses.create(
        model=MODEL, input="Hi", max_output_tokens=5, temperature=0, top_logprobs=3, stream=True
    )
    deltas = [e for e in streamed if e.type == "response.output_text.delta"]
    assert [lp.logprob for e in deltas for lp in e.logprobs] == [entry.logprob for entry in logprobs]


async def test_bad_input_is_a_400_naming_the_field(alice: openai.OpenAI) -> None:
    stored = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    call = {"type": "function_call", "call_id": "c1", "name": "time", "arguments": "{}"}
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "parameters": TIME}]}, "tools.0.name"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
            "tools.0.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}, "input.0.call_id"),
        ({"input": [{**call, "arguments": "{x"}]}, "input.0.arguments"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        (
            {"text": {"format": {"type": "json_object"}}, "tools": TOOLS, "tool_choice": "required"},
            "text.format",
        ),
        ({"include": ["everything"]}, "include.0"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"previous_response_id": stored.id}, "previous_response_id"),  # store=false: cannot continue
    ]
    for extra, param in bad:
        body = {"input": "Hi", "max_output_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError) as raised:
            alice.responses.create(model=MODEL, **body)
        assert raised.value.param == param, (extra, raised.value.param, raised.value.message)  # type: ignore[attr-defined]
        assert param in raised.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        alice.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nothing")
    assert missing.value.param == "previous_response_id"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as og_engine:  # og.Engine gives no logits: as on chat
        alice.responses.create(model=OG_MODEL, input="Hi", max_output_tokens=2, top_logprobs=2)
    assert og_engine.value.param == "top_logprobs" and og_engine.value.code == "unsupported_parameter"  # type: ignore[attr-defined]
    response = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for query, param in [({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")]:
        with pytest.raises(openai.BadRequestError) as raised:
            alice.responses.input_items.list(response.id, **query)  # type: ignore[arg-type]
        assert raised.value.param == param  # type: ignore[attr-defined]


@pytest.mark.default_model
async def test_the_default_model_calls_a_tool_then_answers_from_its_output(smollm2: str) -> None:
    with openai.OpenAI(base_url=smollm2 + "/v1", api_key="unused", max_retries=0) as sdk:
        first = sdk.responses.create(
            model="smollm2",
            input="What is the weather in Paris for the next 3 days?",
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=80,
            temperature=0,
        )
        [call] = first.output
        assert call.type == "function_call" and call.status == "completed"
        assert_valid_call(call.name, call.arguments)
        answer = sdk.responses.create(
            model="smollm2",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}],
            tools=TOOLS,
            tool_choice="none",  # a 135M model answers once it may not call again (docs/api.md)
            max_output_tokens=60,
            temperature=0,
        )
        assert [item.type for item in answer.output] == ["message"]
        assert answer.output_text.strip() and not answer.output_text.startswith("<")
