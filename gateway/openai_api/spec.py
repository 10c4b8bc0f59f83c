"""The OpenAI-compatible routes in `GET /openapi.json`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from gateway.openai_api.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
)

SCHEMA_MODELS: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
    (ChatCompletionRequest, "validation"),
    (CompletionRequest, "validation"),
    (ChatCompletion, "serialization"),
    (ChatCompletionChunk, "serialization"),
    (Completion, "serialization"),
]

_ERROR = {"$ref": "#/components/schemas/Error"}
_JOB_ID_HEADER = {
    "X-Ortfleet-Job-Id": {
        "description": "The id of the job behind each choice, comma-separated in choice order",
        "schema": {"type": "string"},
    }
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event (Open API 3.1 has a stream's `schema` describe each event)."""
    data = {"type": "string", "description": f"a JSON {chunk}, an error envelope, or [DONE]"}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _operation(summary: str, request: type[BaseModel], whole: type[BaseModel], chunk: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {
                "200": {
                    "description": f"the whole {whole.__name__}; with `stream`, SSE of `data: {chunk}` "
                    "events ending with `data: [DONE]`",
                    "headers": _JOB_ID_HEADER,
                    "content": {
                        "application/json": {"schema": _ref(whole)},
                        "text/event-stream": {"schema": _event(chunk)},
                    },
                },
                **{
                    str(code): {"description": "error", "content": {"application/json": {"schema": _ERROR}}}
                    for code in (400, 404, 413, 429, 500, 503)
                },
            },
        }
    }


def paths() -> dict[str, Any]:
    return {
        "/v1/chat/completions": _operation(
            "OpenAI-compatible chat completion", ChatCompletionRequest, ChatCompletion, "ChatCompletionChunk"
        ),
        "/v1/completions": _operation(
            "OpenAI-compatible text completion", CompletionRequest, Completion, "Completion"
        ),
        "/v1/models/{model_id}": {
            "get": {
                "summary": "One model served by live workers (OpenAI's shape)",
                "parameters": [
                    {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": {"description": "the model"},
                    "404": {"description": "not served", "content": {"application/json": {"schema": _ERROR}}},
                },
            }
        },
    }
