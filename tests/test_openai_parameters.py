"""Every request parameter of OpenAI's chat completions, completions and responses is honoured, refused or
ignored as docs/api.md's table says ("Each request parameter")."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.openai_schema import OpenAISchema

API_DOC = Path(__file__).parent.parent / "docs" / "api.md"
ENDPOINTS = {
    "/v1/chat/completions": "CreateChatCompletionRequest",
    "/v1/completions": "CreateCompletionRequest",
    "/v1/responses": "CreateResponse",
}
VERDICTS = ("honoured", "refused", "ignored")

# A value each parameter the table says is ignored (or ignored at some values) is sent with.
IGNORED: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "service_tier": "auto",
        "reasoning_effort": "none",
        "verbosity": "medium",
        "prediction": {"type": "content", "content": "Hello there"},
        "store": True,
        "metadata": {"team": "tests"},
        "user": "user-1",
        "safety_identifier": "user-1",
        "prompt_cache_key": "tests",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"ttl": "30m"},
    },
    "/v1/completions": {"user": "user-1"},
    "/v1/responses": {
        "service_tier": "default",
        "truncation": "disabled",
        "max_tool_calls": 3,
        "stream_options": {"include_obfuscation": False},
        "user": "user-1",
        "safety_identifier": "user-1",
        "prompt_cache_key": "tests",
        "prompt_cache_retention": "in_memory",
        "prompt_cache_options": {"ttl": "30m"},
    },
}
# A value each parameter the table says is refused (at some values) is refused at, and the param named.
REFUSED: dict[str, dict[str, tuple[Any, str]]] = {
    "/v1/chat/completions": {
        "audio": ({"voice": "alloy", "format": "wav"}, "audio"),
        "service_tier": ("flex", "service_tier"),
        "reasoning_effort": ("low", "reasoning_effort"),
        "verbosity": ("low", "verbosity"),
        "web_search_options": ({}, "web_search_options"),
        "moderation": ({"model": "omni-moderation-latest"}, "moderation"),
    },
    "/v1/completions": {
        "suffix": ("!", "suffix"),
        "best_of": (2, "best_of"),
    },
    "/v1/responses": {
        "conversation": ("conv_1", "conversation"),
        "prompt": ({"id": "pmpt_1"}, "prompt"),
        "reasoning": ({"effort": "low"}, "reasoning"),
        "service_tier": ("priority", "service_tier"),
        "truncation": ("auto", "truncation"),
        "context_management": ([{"type": "compaction"}], "context_management"),
        "moderation": ({"model": "omni-moderation-latest"}, "moderation"),
    },
}


def table(endpoint: str) -> dict[str, str]:
    """The table's rows for one endpoint: parameter -> what ortfleet does with it."""
    text = API_DOC.read_text()
    start = text.index(f"(`POST {endpoint}`)\n")
    end = text.find("\n#", start)
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", text[start:end], flags=re.MULTILINE)
    return {name: verdict.strip() for name, verdict in rows}


def properties(schema: OpenAISchema, name: str) -> set[str]:
    node = schema.schema(name)
    found = set(node.get("properties", {}))
    for part in node.get("allOf", []):
        found |= (
            properties(schema, part["$ref"].rsplit("/", 1)[-1]) if "$ref" in part else set(part["properties"])
        )
    return found


@pytest.mark.unit
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_the_table_lists_every_parameter_of_openais_request_body(endpoint: str) -> None:
    rows = table(endpoint)
    assert set(rows) == properties(OpenAISchema(), ENDPOINTS[endpoint])
    assert all(verdict.startswith(VERDICTS) for verdict in rows.values()), rows
    # what the gateway test below sends is what the table says
    assert set(IGNORED[endpoint]) == {name for name, verdict in rows.items() if verdict.startswith("ignored")}
    assert set(REFUSED[endpoint]) == {
        name for name, verdict in rows.items() if "refused" in verdict.split(";")[-1]
    }


def body(endpoint: str, model: str, **extra: Any) -> dict[str, Any]:
    if endpoint == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    if endpoint == "/v1/completions":
        return {"model": model, "prompt": "Hi", "max_tokens": 2, **extra}
    return {"model": model, "input": "Hi", "max_output_tokens": 2, **extra}


@pytest.mark.module_fleet
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_each_parameter_is_refused_or_ignored_as_the_table_says(
    client: httpx.AsyncClient, served: str, endpoint: str
) -> None:
    for name, (value, param) in REFUSED[endpoint].items():
        answer = await client.post(endpoint, json=body(endpoint, served, **{name: value}))
        assert answer.status_code == 400, (name, answer.text)
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == (param, "unsupported_parameter"), name
    for name, value in IGNORED[endpoint].items():
        answer = await client.post(endpoint, json=body(endpoint, served, **{name: value}))
        assert answer.status_code == 200, (name, answer.text)
    answer = await client.post(
        "/v1/responses", json=body("/v1/responses", served, text={"verbosity": "high"})
    )
    assert answer.json()["error"]["param"] == "text.verbosity"
