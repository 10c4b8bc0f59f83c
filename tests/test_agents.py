"""Agent frameworks run their tool loop (call, tool result, answer) on the default model, unmodified,
through chat completions: the OpenAI Agents SDK, a LangGraph ReAct agent, pydantic-ai and LiteLLM.

SmolLM2-135M does not choose a tool by itself, and once it has seen a call it calls again whenever it
may. So each agent forces the first call (`tool_choice` "required", one call at a time) and offers no
tools on the turn that should answer, with the framework's own means; ortfleet keeps every call valid
and keeps the answer in words. All runs are greedy (temperature 0), so they repeat."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.default_model, pytest.mark.slow]

MODEL = "smollm2"
QUESTION = "What is the weather in Paris?"
WEATHER = "It is sunny and 21 degrees in {city}."
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


class Calls:
    """The tools' calls, as the tools themselves received them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def record(self, name: str, **arguments: Any) -> None:
        self.seen.append((name, arguments))

    def names(self) -> list[str]:
        return [name for name, _ in self.seen]


@pytest.fixture
def calls() -> Calls:
    return Calls()


@pytest.fixture(scope="module")
def base_url(smollm2: str) -> str:
    return smollm2 + "/v1"


def assert_answers_in_words(answer: Any) -> None:
    """An answer of the model's own that uses the tool's result, not a copy of a call or a result."""
    assert isinstance(answer, str) and answer.strip(), answer
    assert "<" not in answer and "sunny" in answer.lower(), answer


def weather_message(tool_call_id: str, city: str) -> dict[str, str]:
    return {"role": "tool", "tool_call_id": tool_call_id, "content": WEATHER.format(city=city)}


async def test_the_agents_sdk_runs_an_agent_with_two_tools_to_a_final_answer(
    base_url: str, calls: Calls
) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        ToolCallItem,
        function_tool,
    )

    def not_yet_called(name: str) -> Any:
        # Each tool is offered until it has run once; the last turn has none, so the model answers.
        return lambda _ctx, _agent: name not in calls.names()

    @function_tool(is_enabled=not_yet_called("get_weather"))
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        calls.record("get_weather", city=city)
        return WEATHER.format(city=city)

    @function_tool(is_enabled=not_yet_called("get_local_time"))
    def get_local_time(city: str) -> str:
        """The local time in a city."""
        calls.record("get_local_time", city=city)
        return f"It is 10:30 in {city}."

    tools = {tool.name: tool for tool in (get_weather, get_local_time)}
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    agent: Agent[None] = Agent(
        name="cities",
        instructions="You answer questions about cities with your tools.",
        tools=list(tools.values()),
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        # "required" for the first turn only: the SDK resets tool_choice once a tool has run
        # (Agent.reset_tool_choice), as the model would not call on its own.
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60
        ),
    )
    result = await Runner.run(
        agent,
        "What are the weather and the local time in Paris?",
        run_config=RunConfig(tracing_disabled=True),
        max_turns=4,
    )
    await client.close()
    assert sorted(calls.names()) == ["get_local_time", "get_weather"], calls.seen
    made = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert len(made) == 2
    for call in made:
        name, arguments = getattr(call, "name"), getattr(call, "arguments")  # noqa: B009
        jsonschema.validate(json.loads(arguments), tools[name].params_json_schema)
    assert_answers_in_words(result.final_output)


# LangGraph 1.x moved create_react_agent to the langchain package (create_agent); it still serves.
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
async def test_a_langgraph_react_agent_calls_a_bound_tool_and_answers_from_its_result(
    base_url: str, calls: Calls
) -> None:
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        calls.record("get_weather", city=city)
        return WEATHER.format(city=city)

    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=60)
    calling = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)

    def pick_model(state: dict[str, Any], _runtime: Any) -> Any:
        # A call first (bind_tools, "required"); once a result is in, the plain model answers.
        answered = any(isinstance(m, ToolMessage) for m in state["messages"])
        return llm if answered else calling

    agent = create_react_agent(pick_model, [get_weather])
    final = await agent.ainvoke({"messages": [("user", QUESTION)]})
    messages = final["messages"]
    assert calls.seen == [("get_weather", {"city": "Paris"})]
    [asked] = [m for m in messages if isinstance(m, AIMessage) and m.tool_calls]
    jsonschema.validate(asked.tool_calls[0]["args"], get_weather.tool_call_schema.model_json_schema())
    assert isinstance(messages[-2], ToolMessage) and isinstance(messages[-1], AIMessage)
    assert not messages[-1].tool_calls
    assert_answers_in_words(messages[-1].content)


async def test_a_pydantic_ai_agent_calls_its_tool_and_answers(base_url: str, calls: Calls) -> None:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    def settings(ctx: RunContext[None]) -> ModelSettings:
        # The first request must call; the next one may only answer.
        tool_choice = "required" if ctx.run_step <= 1 else "none"
        return ModelSettings(temperature=0, max_tokens=60, parallel_tool_calls=False, tool_choice=tool_choice)

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    agent = Agent(model, model_settings=settings)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        calls.record("get_weather", city=city)
        return WEATHER.format(city=city)

    result = await agent.run(QUESTION)
    assert calls.names() == ["get_weather"]
    [part] = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    jsonschema.validate(part.args_as_dict(), CITY_SCHEMA)
    assert_answers_in_words(result.output)


@pytest.fixture
def litellm() -> Iterator[Any]:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
    import litellm

    yield litellm


async def test_litellm_gets_a_valid_tool_call_and_answers_from_its_result(
    base_url: str, litellm: Any
) -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city.",
            "parameters": CITY_SCHEMA,
        },
    }
    common: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": base_url,
        "api_key": "unused",
        "temperature": 0,
        "max_tokens": 60,
    }
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    asked: Any = await litellm.acompletion(
        **common, messages=messages, tools=[weather], tool_choice="required", parallel_tool_calls=False
    )
    choice = asked.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather"
    jsonschema.validate(arguments, CITY_SCHEMA)
    messages += [choice.message.model_dump(), weather_message(call.id, arguments["city"])]
    answered: Any = await litellm.acompletion(
        **common, messages=messages, tools=[weather], tool_choice="none"
    )
    assert answered.choices[0].finish_reason == "stop"
    assert_answers_in_words(answered.choices[0].message.content)


@pytest.mark.parametrize("tools", ["none", "absent"])
async def test_after_a_tool_result_a_turn_without_calls_answers_in_words_not_in_tool_tags(
    base_url: str, tools: str
) -> None:
    """Without the rule that keeps such an answer from beginning with "<", the default model repeats
    the `<tool_response>` tags it sees in the conversation."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    }
    messages: list[Any] = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        weather_message("call_1", "Paris"),
    ]
    offered: dict[str, Any] = {}
    if tools == "none":
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": CITY_SCHEMA}}
        offered = {"tools": [weather], "tool_choice": "none"}
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as sdk:
        reply = await sdk.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=40, **offered
        )
    assert reply.choices[0].message.tool_calls is None
    assert_answers_in_words(reply.choices[0].message.content)
