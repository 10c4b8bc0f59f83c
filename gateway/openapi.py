"""`GET /openapi.json`: the HTTP surface, with schemas generated from the wire models."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.wire import JobRequest, JobView
from gateway import async_spec
from gateway.openai_api import spec as openai_spec

_ERROR = {"$ref": "#/components/schemas/Error"}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_PUBLIC = {"/healthz", "/readyz", "/health", "/version"}
_JOB_PAGE = {
    "type": "object",
    "required": ["object", "data", "has_more", "next_cursor"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {"$ref": "#/components/schemas/JobView"}},
        "has_more": {"type": "boolean"},
        "next_cursor": {"type": ["string", "null"]},
    },
}
_JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(code): {"description": "error", **_json(_ERROR)} for code in codes}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _tokenizer_operation(summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary + ", answered by a worker of the model",
            "requestBody": {"required": True, **_json({"type": "object"})},
            "responses": {
                "200": {"description": "ok", **_json({"type": "object"})},
                **_errors(400, 404, 503, 504),
            },
        }
    }


def build_spec(version: str) -> dict[str, Any]:
    _, defs = models_json_schema(
        [
            (JobRequest, "validation"),
            (JobView, "serialization"),
            *openai_spec.SCHEMA_MODELS,
            *async_spec.SCHEMA_MODELS,
        ],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = {**defs.get("$defs", {}), "Error": _ERROR_SCHEMA}
    job = _ref(JobView)
    paths: dict[str, Any] = {
        "/v1/jobs": {
            "post": {
                "summary": "Submit a generation job",
                "parameters": [{"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"}}],
                "requestBody": {"required": True, **_json(_ref(JobRequest))},
                "responses": {
                    "202": {"description": "queued", **_json(job)},
                    **_errors(400, 404, 413, 422, 429, 503),
                },
            },
            "get": {
                "summary": "The caller's jobs, newest first, a page at a time",
                "parameters": [
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                    {
                        "name": "after",
                        "in": "query",
                        "schema": {"type": "string", "pattern": r"^[0-9]+\.[A-Za-z0-9_-]+$"},
                    },
                ],
                "responses": {"200": {"description": "a page of jobs", **_json(_JOB_PAGE)}, **_errors(422)},
            },
        },
        "/v1/jobs/{job_id}": {
            "get": {
                "summary": "A job's status and result; `wait` long-polls until it ends",
                "parameters": [
                    _JOB_ID,
                    {"name": "wait", "in": "query", "schema": {"type": "number", "minimum": 0}},
                ],
                "responses": {"200": {"description": "the job", **_json(job)}, **_errors(404, 422, 503)},
            },
            "delete": {
                "summary": "Cancel a job; with purge=true, also delete all of its data at once",
                "parameters": [_JOB_ID, {"name": "purge", "in": "query", "schema": {"type": "boolean"}}],
                "responses": {
                    "200": {"description": "cancelled (or already ended)", **_json(job)},
                    "202": {"description": "running; it stops within one engine step", **_json(job)},
                    "204": {"description": "purged"},
                    **_errors(404, 503),
                },
            },
        },
        "/v1/jobs/{job_id}/events": {
            "get": {
                "summary": "SSE: status, token, done/error events; resumable by Last-Event-ID or after",
                "parameters": [
                    _JOB_ID,
                    {
                        "name": "after",
                        "in": "query",
                        "schema": {"type": "string", "pattern": r"^[0-9]{1,20}-[0-9]{1,20}$"},
                    },
                    {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": {
                        "description": "event stream",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    },
                    **_errors(404, 422, 503),
                },
            }
        },
        "/v1/models": {
            "get": {
                "summary": "Models served by live workers",
                "responses": {"200": {"description": "models"}},
            }
        },
        "/v1/fleet": {
            "get": {
                "summary": "Models, live workers, queues and Redis problems; load figures only without keys "
                "or with the metrics key",
                "responses": {"200": {"description": "the fleet", **_json({"type": "object"})}},
            }
        },
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": {"description": "alive"}}}},
        "/readyz": {
            "get": {
                "summary": "Readiness: Redis reachable and a live worker",
                "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
            }
        },
        "/v1/jobs/{job_id}/stream-token": {
            "post": {
                "summary": "A signed token that opens the job's events from a browser's EventSource",
                "parameters": [_JOB_ID],
                "responses": {
                    "201": {"description": "token, expires_at and events_url", **_json({"type": "object"})},
                    **_errors(404, 501),
                },
            }
        },
        "/health": {
            "get": {
                "summary": "vLLM's and TGI's health check: 200, empty, while a worker serves",
                "responses": {"200": {"description": "serving"}, "503": {"description": "not serving"}},
            }
        },
        "/version": {"get": {"summary": "ortfleet's version", "responses": {"200": {"description": "ok"}}}},
        "/tokenize": _tokenizer_operation("vLLM's: a prompt or chat messages as the model's token ids"),
        "/detokenize": _tokenizer_operation("vLLM's: token ids as text"),
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics of this gateway, and queue depth per model from Redis",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }
    paths.update(openai_spec.paths())
    paths.update(async_spec.paths())
    for path, operations in paths.items():
        if path in _PUBLIC:
            continue
        for operation in operations.values():
            operation["security"] = [{"apiKey": []}]
            operation["responses"].update(_errors(401, 429))
    return {
        "openapi": "3.1.0",
        "info": {"title": "ortfleet", "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Needed once API keys are configured; /metrics has a key of its own.",
                }
            },
        },
    }


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


routes = [Route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)]
