"""The Files, Batches and Responses routes in `GET /openapi.json`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from gateway.batches.routes import BatchRequest
from gateway.responses.protocol import ResponseRequest

SCHEMA_MODELS: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
    (BatchRequest, "validation"),
    (ResponseRequest, "validation"),
]

_ERROR = {"$ref": "#/components/schemas/Error"}
_OBJECT = {"type": "object"}
_STRING = {"type": "string"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(code): {"description": "error", **_json(_ERROR)} for code in codes}


def _path(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": _STRING}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "schema": schema}


def _list(item: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _OBJECT}},
        "description": f"a page of {item}",
    }


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": _STRING, "data": {"type": "string", "description": "the event as JSON"}},
    "description": "one server-sent event of OpenAI's Responses stream",
}
_SSE = {"text/event-stream": {"schema": _EVENT}}


def paths() -> dict[str, Any]:
    upload = {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"const": "batch"}},
    }
    file_id, batch_id, response_id = _path("file_id"), _path("batch_id"), _path("response_id")
    return {
        "/v1/files": {
            "post": {
                "summary": "Upload a JSONL file (purpose batch), read as a stream; capped by max_file_bytes",
                "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": upload}}},
                "responses": {"200": {"description": "the file", **_json(_OBJECT)}, **_errors(400, 413, 503)},
            },
            "get": {
                "summary": "The caller's files, newest first",
                "parameters": [
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000}),
                    _query("after", _STRING),
                    _query("purpose", _STRING),
                ],
                "responses": {"200": {"description": "files", **_json(_list("files"))}, **_errors(400)},
            },
        },
        "/v1/files/{file_id}": {
            "get": {
                "summary": "A file's details",
                "parameters": [file_id],
                "responses": {"200": {"description": "the file", **_json(_OBJECT)}, **_errors(404)},
            },
            "delete": {
                "summary": "Delete a file (409 while a batch that has not ended reads it)",
                "parameters": [file_id],
                "responses": {"200": {"description": "deleted", **_json(_OBJECT)}, **_errors(404, 409)},
            },
        },
        "/v1/files/{file_id}/content": {
            "get": {
                "summary": "A file's bytes",
                "parameters": [file_id],
                "responses": {
                    "200": {
                        "description": "the file",
                        "content": {"application/octet-stream": {"schema": {"type": "string"}}},
                    },
                    **_errors(404, 503),
                },
            }
        },
        "/v1/batches": {
            "post": {
                "summary": "Start a batch over an uploaded file; its lines run as jobs of the batch class",
                "requestBody": {"required": True, **_json(_ref(BatchRequest))},
                "responses": {"200": {"description": "the batch", **_json(_OBJECT)}, **_errors(400, 404)},
            },
            "get": {
                "summary": "The caller's batches, newest first",
                "parameters": [
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                    _query("after", _STRING),
                ],
                "responses": {"200": {"description": "batches", **_json(_list("batches"))}, **_errors(400)},
            },
        },
        "/v1/batches/{batch_id}": {
            "get": {
                "summary": "A batch's status, request counts and files",
                "parameters": [batch_id],
                "responses": {"200": {"description": "the batch", **_json(_OBJECT)}, **_errors(404)},
            }
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": {
                "summary": "Cancel a batch: no line fed any more, queued ones cancelled, running ones finish",
                "parameters": [batch_id],
                "responses": {"200": {"description": "the batch", **_json(_OBJECT)}, **_errors(404)},
            }
        },
        "/v1/responses": {
            "post": {
                "summary": "Create a response (text, function tools, structured text): foreground, streamed "
                "or in the background; `previous_response_id` continues a stored one",
                "requestBody": {"required": True, **_json(_ref(ResponseRequest))},
                "responses": {
                    "200": {
                        "description": "the response; with `stream`, its events as SSE",
                        "content": {"application/json": {"schema": _OBJECT}, **_SSE},
                    },
                    **_errors(400, 404, 429, 503),
                },
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "A response; with stream=true its events after `starting_after`, from any gateway",
                "parameters": [
                    response_id,
                    _query("stream", {"type": "boolean"}),
                    _query("starting_after", {"type": "integer"}),
                ],
                "responses": {
                    "200": {
                        "description": "the response, or its events as SSE",
                        "content": {"application/json": {"schema": _OBJECT}, **_SSE},
                    },
                    **_errors(400, 404),
                },
            },
            "delete": {
                "summary": "Delete a stored response and its job",
                "parameters": [response_id],
                "responses": {"200": {"description": "deleted", **_json(_OBJECT)}, **_errors(404)},
            },
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "A response's input items (its whole conversation), a page at a time",
                "parameters": [
                    response_id,
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                    _query("order", {"enum": ["asc", "desc"]}),
                    _query("after", _STRING),
                ],
                "responses": {
                    "200": {"description": "input items", **_json(_list("input items"))},
                    **_errors(400, 404),
                },
            }
        },
        "/v1/responses/{response_id}/cancel": {
            "post": {
                "summary": "Cancel a background response",
                "parameters": [response_id],
                "responses": {"200": {"description": "the response", **_json(_OBJECT)}, **_errors(400, 404)},
            }
        },
    }
