"""`GET /openapi.json`: rendered from the app's routes, the `Operation` declared on each route's handler,
and the JSON schemas of the models those name (requests as validated, answers as serialized)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaValue, models_json_schema
from starlette.convertors import Convertor, FloatConvertor, IntegerConvertor
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.auth import PUBLIC_PATHS
from gateway.errors import Error
from gateway.operations import Body, Events, Operation, Reply, Schema, operation_of

Mode = Literal["validation", "serialization"]
Refs = dict[tuple[Any, Mode], JsonSchemaValue]  # a model and mode: its `$ref`

KEYED_ERRORS = (401, 429)  # what every route that needs a key may answer besides its own errors
_CONVERTOR = re.compile(r"{([^}:]+):[^}]+}")  # `{model_id:path}` is `{model_id}` in the document
_PATH_TYPES: dict[type[Convertor[Any]], str] = {IntegerConvertor: "integer", FloatConvertor: "number"}


@dataclass(frozen=True)
class Documented:
    """One method of a served route and its operation."""

    path: str
    method: str
    operation: Operation
    path_params: list[dict[str, Any]]


def documented(routes: Sequence[BaseRoute]) -> Iterator[Documented]:
    """Every method of every route in the schema; a route without an `Operation` is an error."""
    for route in routes:
        if not isinstance(route, Route) or not route.include_in_schema:
            continue
        operation = operation_of(route.endpoint)
        if operation is None:
            raise ValueError(f"route {route.path} has no Operation; declare one on {route.name}")
        path = _CONVERTOR.sub(r"{\1}", route.path)
        params = [_path_param(name, convertor) for name, convertor in route.param_convertors.items()]
        for method in sorted(route.methods or ()):
            if method != "HEAD":  # Starlette answers HEAD wherever GET is
                yield Documented(path, method.lower(), operation, params)


def build_spec(routes: Sequence[BaseRoute], version: str) -> dict[str, Any]:
    operations = list(documented(routes))
    refs, defs = models_json_schema(_models(operations), ref_template="#/components/schemas/{model}")
    paths: dict[str, Any] = {}
    for found in operations:
        rendered = _operation(found, refs)
        if found.path not in PUBLIC_PATHS:
            rendered["security"] = [{"apiKey": []}]
            rendered["responses"].update(_errors(KEYED_ERRORS, refs))
        paths.setdefault(found.path, {})[found.method] = rendered
    return {
        "openapi": "3.1.0",
        "info": {"title": "ortfleet", "version": version},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Needed once API keys are configured; /metrics has a key of its own.",
                }
            },
        },
    }


def _models(operations: list[Documented]) -> list[tuple[type[BaseModel], Mode]]:
    """Each model the operations name, once per mode: requests as validated, everything else as sent."""
    models: dict[tuple[type[BaseModel], Mode], None] = {(Error, "serialization"): None}
    for found in operations:
        operation = found.operation
        if isinstance(operation.request, type):
            models[operation.request, "validation"] = None
        for reply in operation.responses.values():
            if isinstance(reply.body, type):
                models[reply.body, "serialization"] = None
            if isinstance(reply.stream, Events) and reply.stream.model is not None:
                models[reply.stream.model, "serialization"] = None
    return list(models)


def _operation(found: Documented, refs: Refs) -> dict[str, Any]:
    operation = found.operation
    rendered: dict[str, Any] = {"summary": operation.summary}
    params = [*found.path_params, *(_param(p.name, p.where, p.schema) for p in operation.params)]
    if params:
        rendered["parameters"] = params
    if operation.request is not None:
        schema = _schema(operation.request, "validation", refs)
        rendered["requestBody"] = {
            "required": True,
            "content": {operation.request_media_type: {"schema": schema}},
        }
    responses = {str(status): _reply(reply, refs) for status, reply in operation.responses.items()}
    rendered["responses"] = {**responses, **_errors(operation.errors, refs)}
    return rendered


def _reply(reply: Reply, refs: Refs) -> dict[str, Any]:
    rendered: dict[str, Any] = {"description": reply.description}
    if reply.headers:
        rendered["headers"] = {
            name: {"description": about, "schema": {"type": "string"}}
            for name, about in reply.headers.items()
        }
    content: dict[str, Any] = {}
    if reply.body is not None:
        content[reply.media_type] = {"schema": _schema(reply.body, "serialization", refs)}
    if reply.stream is not None:
        stream = _event(reply.stream) if isinstance(reply.stream, Events) else reply.stream
        content["text/event-stream"] = {"schema": stream}
    if content:
        rendered["content"] = content
    return rendered


def _event(events: Events) -> Schema:
    """One server-sent event (OpenAPI 3.1 has a stream's `schema` describe each event)."""
    properties: Schema = {"data": {"type": "string", "description": events.data}}
    if events.named:
        properties = {"event": {"type": "string"}, **properties}
    event: Schema = {"type": "object", "required": ["data"], "properties": properties}
    if events.about is not None:
        event["description"] = events.about
    return event


def _errors(statuses: Sequence[int], refs: Refs) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": refs[Error, "serialization"]}}}
    return {str(status): {"description": "error", **error} for status in statuses}


def _schema(body: Body, mode: Mode, refs: Refs) -> Schema:
    return refs[body, mode] if isinstance(body, type) else body


def _param(name: str, where: str, schema: Schema) -> dict[str, Any]:
    return {"name": name, "in": where, "schema": schema}


def _path_param(name: str, convertor: Convertor[Any]) -> dict[str, Any]:
    schema = {"type": _PATH_TYPES.get(type(convertor), "string")}
    return {**_param(name, "path", schema), "required": True}


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


routes = [Route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)]
