"""Tool calling on chat completions, through the official `openai` SDK on a real fleet. The tiny model's
output is random: only the grammar that constrains its decoding makes its calls valid."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from gateway.openai_api.tool_calls import CallReader, read_answer
from gateway.openai_api.tools import FunctionDef, ToolPlan
from tests.test_batches import BatchFleet, batch_fleet, jsonl, line, until_status, upload

__all__ = ["batch_fleet"]  # the fixture, shared with tests/test_batches.py

# One gateway and one served worker for the module's tests; the batch test starts a fleet of its own
# (batch_fleet), whose gateway, told of the batch at once, drives it.
pytestmark = pytest.mark.module_fleet

# Small on purpose: the tiny model's context is 512 tokens of a few characters each.
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "parameters": TIME}},
]
PING = {"type": "object", "properties": {}, "additionalProperties": False}  # what no parameters mean
SCHEMAS = {"weather": WEATHER, "time": TIME, "ping": PING}
# For `required` and `auto`, which show the model every tool.
SMALL_TOOLS: list[Any] = [TOOLS[1], {"type": "function", "function": {"name": "ping"}}]


def chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def assert_valid_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed_calls(stream: Iterator[Any]) -> tuple[str, list[dict[str, str]], str | None]:
    """The text, the calls (id, name, arguments) and the finish reason of a streamed chat choice."""
    text, calls, finish = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index == len(calls) and piece.type == "function"
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return text, calls, finish


TWO_CALLS = (
    '<tool_call>{"name":"weather","arguments":{"city":"a}</tool_call>\\"b","days":2}}</tool_call>\n'
    '<tool_call>{"name":"ping","arguments":{}}</tool_call>'
)


@pytest.mark.unit
def test_calls_read_in_any_pieces_are_the_calls_read_whole() -> None:
    whole = read_answer(TWO_CALLS)
    assert [(c.name, json.loads(c.arguments)) for c in whole.complete_calls()] == [
        ("weather", {"city": 'a}</tool_call>"b', "days": 2}),
        ("ping", {}),
    ]
    for size in (1, 2, 5, 13):
        reader, names, arguments = CallReader(), [], ["", ""]
        for start in range(0, len(TWO_CALLS), size):
            text, pieces = reader.feed(TWO_CALLS[start : start + size])
            assert text == ""
            for piece in pieces:
                if piece.name is not None:
                    names.append(piece.name)
                arguments[piece.index] += piece.arguments
        assert names == ["weather", "ping"]
        assert arguments == [c.arguments for c in whole.complete_calls()]


@pytest.mark.unit
def test_a_cut_call_is_not_complete_and_text_stays_text() -> None:
    assert read_answer(TWO_CALLS[:40]).complete_calls() == []
    assert read_answer(TWO_CALLS[:40]).made_calls
    answer = read_answer("Sunny. <tool_call>")
    assert not answer.made_calls and answer.text == "Sunny. <tool_call>"


@pytest.mark.unit
def test_a_tool_whose_parameters_say_nothing_of_other_keys_gets_only_its_declared_ones() -> None:
    from llguidance import LLMatcher

    from gateway.guidance_check import _tokenizer

    open_tool = {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "where": {"type": "object", "properties": {}}},
            "required": ["city"],
        },
    }
    free_tool = {"name": "note", "parameters": {"type": "object", "additionalProperties": True}}
    plan = ToolPlan(
        [FunctionDef.model_validate(open_tool), FunctionDef.model_validate(free_tool)], "required"
    )

    def allows(text: str) -> bool:
        matcher = LLMatcher(_tokenizer(), LLMatcher.grammar_from_lark(plan.grammar()), log_level=0)
        return bool(matcher.consume_tokens(list(text.encode()))) and matcher.is_accepting()

    assert allows('<tool_call>{"name":"weather","arguments":{"city":"Paris"}}</tool_call>')
    # og.Engine's grammar had let a weak model add keys until max_tokens: closed as OpenAI's strict mode
    assert not allows('<tool_call>{"name":"weather","arguments":{"city":"Paris","type":"x"}}</tool_call>')
    assert not allows('<tool_call>{"name":"weather","arguments":{"city":"P","where":{"a":1}}}</tool_call>')
    assert allows('<tool_call>{"name":"note","arguments":{"anything":1}}</tool_call>')  # it says so


@pytest.mark.unit
def test_the_grammar_allows_only_the_named_function_with_valid_arguments() -> None:
    from llguidance import LLMatcher

    from gateway.guidance_check import _tokenizer

    functions = [FunctionDef.model_validate(t["function"]) for t in TOOLS]

    def allows(plan: ToolPlan, text: str) -> bool:
        matcher = LLMatcher(_tokenizer(), LLMatcher.grammar_from_lark(plan.grammar()), log_level=0)
        return bool(matcher.consume_tokens(list(text.encode()))) and matcher.is_accepting()

    named = ToolPlan(functions, "named", "time")
    assert allows(named, '<tool_call>{"name":"time","arguments":{"zone":"UTC"}}</tool_call>')
    assert not allows(named, '<tool_call>{"name":"time","arguments":{"zone":"EST"}}</tool_call>')
    assert not allows(named, '<tool_call>{"name":"weather","arguments":{"city":"P","days":1}}</tool_call>')
    assert not allows(named, "It is noon.")
    auto = ToolPlan(functions, "auto")
    assert allows(auto, "It is noon.")
    assert allows(auto, '<tool_call>{"name":"weather","arguments":{"city":"P","days":1}}</tool_call>')
    assert not allows(auto, '<tool_call>{"name":"weather","arguments":{"city":"P"}}</tool_call>')


@pytest.mark.unit
def test_a_pydantic_tool_with_nested_models_keeps_its_definitions() -> None:
    from llguidance import LLMatcher
    from pydantic import BaseModel

    from gateway.guidance_check import _tokenizer

    class City(BaseModel):
        name: str

    class Trip(BaseModel):
        to: City
        days: int

    tool: Any = openai.pydantic_function_tool(Trip)
    assert "$defs" in tool["function"]["parameters"]
    plan = ToolPlan([FunctionDef.model_validate(tool["function"])], "required")
    matcher = LLMatcher(_tokenizer(), LLMatcher.grammar_from_lark(plan.grammar()), log_level=0)
    call = '<tool_call>{"name":"Trip","arguments":{"to":{"name":"Nice"},"days":2}}</tool_call>'
    assert matcher.consume_tokens(list(call.encode())) and matcher.is_accepting()


async def test_a_named_tool_call_follows_the_tools_schema(sdk: openai.OpenAI, served: str) -> None:
    for temperature in (0.0, 1.0):
        completion = sdk.chat.completions.create(
            model=served,
            messages=chat("Weather?"),
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "weather"}},
            max_tokens=100,
            temperature=temperature,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1
        call = calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name == "weather"
        assert_valid_call(call.function.name, call.function.arguments)


async def test_a_required_tool_call_is_one_of_the_tools_and_follows_its_schema(
    sdk: openai.OpenAI, served: str
) -> None:
    for seed in range(3):
        completion = sdk.chat.completions.create(
            model=served,
            messages=chat("Call a tool."),
            tools=SMALL_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert_valid_call(call.function.name, call.function.arguments)


async def test_parallel_calls_are_each_valid_and_have_their_own_ids(sdk: openai.OpenAI, served: str) -> None:
    completion = sdk.chat.completions.create(
        model=served,
        messages=chat("Call the tools."),
        tools=SMALL_TOOLS,
        tool_choice="required",
        max_tokens=60,
        seed=7,
    )
    choice = completion.choices[0]
    calls = choice.message.tool_calls or []
    if choice.finish_reason == "tool_calls":
        assert calls
    else:  # the random model went on calling until max_tokens: the call it was writing is left out
        assert choice.finish_reason == "length"
    for call in calls:
        assert_valid_call(call.function.name, call.function.arguments)
    assert len({call.id for call in calls}) == len(calls)


async def test_a_streamed_tool_call_comes_as_openai_streams_it(sdk: openai.OpenAI, served: str) -> None:
    for choice in ({"type": "function", "function": {"name": "time"}}, "required"):
        stream = sdk.chat.completions.create(
            model=served,
            messages=chat("Time?"),
            tools=SMALL_TOOLS,
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_tokens=80,  # a call is 50 to 60 of the tiny model's tokens
            stream=True,
        )
        text, calls, finish = streamed_calls(stream)
        assert text == "" and finish == "tool_calls" and len(calls) == 1
        assert calls[0]["id"].startswith("call_")
        assert_valid_call(calls[0]["name"], calls[0]["arguments"])
        if choice != "required":
            assert calls[0]["name"] == "time"


async def test_auto_answers_with_text_or_a_valid_call(sdk: openai.OpenAI, served: str) -> None:
    kinds = set()
    for seed in range(6):
        completion = sdk.chat.completions.create(
            model=served, messages=chat("Hi"), tools=SMALL_TOOLS, max_tokens=30, seed=seed
        )
        choice = completion.choices[0]
        if choice.message.tool_calls:
            kinds.add("call")
            assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
            for call in choice.message.tool_calls:
                assert_valid_call(call.function.name, call.function.arguments)
        else:
            kinds.add("text")
            assert choice.finish_reason in ("stop", "length")
            assert choice.message.content is not None and not choice.message.content.startswith("<")
    assert kinds
    stream = sdk.chat.completions.create(
        model=served, messages=chat("Hi"), tools=SMALL_TOOLS, tool_choice="auto", max_tokens=30, stream=True
    )
    text, calls, finish = streamed_calls(stream)
    assert bool(text) != bool(calls) or (not text and not calls and finish == "length")
    for call in calls:
        if finish == "tool_calls":
            assert_valid_call(call["name"], call["arguments"])


async def test_streamed_text_beside_tools_carries_its_logprobs(sdk: openai.OpenAI, served: str) -> None:
    for seed in range(4):
        stream = sdk.chat.completions.create(
            model=served,
            messages=chat("Hi"),
            tools=SMALL_TOOLS,
            max_tokens=20,
            seed=seed,
            logprobs=True,
            stream=True,
        )
        chunks = [chunk for chunk in stream if chunk.choices]
        texts = [c for c in chunks if c.choices[0].delta.content]
        if texts:
            assert all(c.choices[0].logprobs and c.choices[0].logprobs.content for c in texts)
            return
    pytest.fail("the model called a tool on every seed")


async def test_an_agent_loop_of_call_result_and_answer_completes(sdk: openai.OpenAI, served: str) -> None:
    messages: list[Any] = chat("Weather?")
    first = sdk.chat.completions.create(
        model=served, messages=messages, tools=SMALL_TOOLS, tool_choice="required", max_tokens=80, seed=1
    )
    calls = first.choices[0].message.tool_calls
    assert calls
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'})
    answer = sdk.chat.completions.create(
        model=served, messages=messages, tools=SMALL_TOOLS, tool_choice="none", max_tokens=20, seed=1
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


async def test_a_model_says_how_tools_reach_it(sdk: openai.OpenAI, served: str) -> None:
    model = sdk.models.retrieve(served)
    assert (model.model_extra or {}).get("tool_prompt") == "ortfleet"


async def test_tool_choice_none_with_tools_answers_in_text(sdk: openai.OpenAI, served: str) -> None:
    completion = sdk.chat.completions.create(
        model=served, messages=chat("Hi"), tools=TOOLS, tool_choice="none", max_tokens=10, seed=3
    )
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and choice.message.content is not None
    assert choice.finish_reason in ("stop", "length")


async def test_legacy_functions_answer_with_a_function_call(sdk: openai.OpenAI, served: str) -> None:
    completion = sdk.chat.completions.create(
        model=served,
        messages=chat("Time?"),
        functions=[{"name": "time", "parameters": TIME}],
        function_call={"name": "time"},
        max_tokens=100,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.function_call is not None and choice.message.function_call.name == "time"
    assert_valid_call("time", choice.message.function_call.arguments)


async def test_bad_tools_are_refused_naming_the_field(sdk: openai.OpenAI, served: str) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "function", "function": {"parameters": TIME}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "required": 3}},
                    }
                ]
            },
            "tools.0.function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {  # each schema is fine, but together they make too long a grammar
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": f"t{i}",
                            "parameters": {"type": "object", "properties": {"a": {"enum": ["x" * 600]}}},
                        },
                    }
                    for i in range(100)
                ]
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "response_format": {"type": "json_object"}, "tool_choice": "required"},
            "response_format",
        ),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(model=served, messages=chat("Hi"), extra_body=extra)
        assert raised.value.param == param, (extra, raised.value.param, raised.value.message)
        assert param in raised.value.message
    bad_history: list[Any] = [
        *chat("Hi"),
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
        },
    ]
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(model=served, messages=bad_history, tools=TOOLS)
    assert raised.value.param == "messages.1.tool_calls.0.function.arguments"


async def test_a_tool_result_that_answers_no_call_is_refused_naming_its_field(
    sdk: openai.OpenAI, served: str
) -> None:
    called: dict[str, Any] = {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "time", "arguments": "{}"}}],
    }
    bad: list[tuple[list[Any], str]] = [
        (
            [*chat("Hi"), called, {"role": "tool", "tool_call_id": "c2", "content": "1"}],
            "messages.2.tool_call_id",
        ),
        ([*chat("Hi"), called, {"role": "tool", "content": "1"}], "messages.2.tool_call_id"),
        ([*chat("Hi"), {"role": "tool", "tool_call_id": "c1", "content": "1"}], "messages.1.role"),
        (
            [*chat("Hi"), called, *chat("And?"), {"role": "tool", "tool_call_id": "c1", "content": "1"}],
            "messages.3.role",
        ),
    ]
    for messages, param in bad:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(model=served, messages=messages, max_tokens=2)
        assert raised.value.param == param, (messages, raised.value.message)
        assert raised.value.type == "invalid_request_error" and param in raised.value.message
    answered = [*chat("Hi"), called, {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    completion = sdk.chat.completions.create(model=served, messages=answered, max_tokens=2)
    assert completion.choices[0].finish_reason in ("stop", "length")


async def test_a_batch_line_with_tools_is_refused_naming_tools(
    batch_fleet: BatchFleet, model_name: str
) -> None:
    _, sdk = batch_fleet()
    lines = [
        line("calls", model_name, "Time?", tools=SMALL_TOOLS),
        line("no-calls", model_name, "Time?", tools=SMALL_TOOLS, tool_choice="none"),
    ]
    created = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = await until_status(sdk, created.id, "completed")
    [error] = jsonl(sdk, batch.error_file_id)
    assert error["custom_id"] == "calls" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "tools"
    assert [o["custom_id"] for o in jsonl(sdk, batch.output_file_id)] == ["no-calls"]


@pytest.mark.default_model
async def test_the_default_model_makes_a_named_call_that_follows_the_schema(smollm2: str) -> None:
    with openai.OpenAI(base_url=smollm2 + "/v1", api_key="unused", max_retries=0) as sdk:
        completion = sdk.chat.completions.create(
            model="smollm2",
            messages=chat("What is the weather in Paris for the next 3 days, in celsius?"),
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "weather"}},
            max_tokens=80,
            temperature=0,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        call = choice.message.tool_calls[0]
        assert call.function.name == "weather"
        assert_valid_call(call.function.name, call.function.arguments)
        stream = sdk.chat.completions.create(
            model="smollm2",
            messages=chat("What is the weather in Paris for the next 3 days, in celsius?"),
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
            stream=True,
        )
        _, calls, finish = streamed_calls(stream)
        assert finish == "tool_calls" and len(calls) == 1
        assert_valid_call(calls[0]["name"], calls[0]["arguments"])
