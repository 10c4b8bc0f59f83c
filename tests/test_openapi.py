"""`GET /openapi.json` is rendered from the routes the app serves and the operations declared on their
handlers: nothing served is left out, nothing documented is not served, and the document is valid
OpenAPI 3.1."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel
from schemathesis.specs.openapi.definitions import OPENAPI_31
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.gateway_settings import GatewaySettings
from gateway.app import build_app
from gateway.auth import PUBLIC_PATHS
from gateway.metrics import GatewayMetrics
from gateway.openapi import build_spec
from gateway.operations import Events, Operation, Param, Reply

pytestmark = pytest.mark.unit

METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


@pytest.fixture(scope="module")
def app_and_document() -> tuple[Any, dict[str, Any]]:
    app = build_app(GatewaySettings(), GatewayMetrics())
    return app, app.state.openapi


def _served(app: Any) -> set[tuple[str, str]]:
    served = set()
    for route in app.routes:
        if isinstance(route, Route) and route.include_in_schema:
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
            served |= {(method.lower(), path) for method in route.methods or () if method != "HEAD"}
    return served


def _refs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_every_served_route_is_documented_and_every_documented_one_is_served(
    app_and_document: tuple[Any, dict[str, Any]],
) -> None:
    app, document = app_and_document
    documented = {
        (method, path) for path, item in document["paths"].items() for method in item if method in METHODS
    }
    served = _served(app)
    assert served, "the app serves routes"
    assert served - documented == set(), "served but not in /openapi.json"
    assert documented - served == set(), "in /openapi.json but not served"


def test_routes_kept_out_of_the_schema_are_not_documented(
    app_and_document: tuple[Any, dict[str, Any]],
) -> None:
    app, document = app_and_document
    hidden = {route.path for route in app.routes if isinstance(route, Route) and not route.include_in_schema}
    assert {"/openapi.json", "/"} <= hidden
    assert hidden.isdisjoint(document["paths"])


def test_every_ref_resolves(app_and_document: tuple[Any, dict[str, Any]]) -> None:
    _, document = app_and_document
    refs = set(_refs(document))
    assert "#/components/schemas/Error" in refs
    for ref in refs:
        node: Any = document
        assert ref.startswith("#/"), ref
        for part in ref[2:].split("/"):
            assert part in node, f"{ref} does not resolve"
            node = node[part]


def test_the_document_is_valid_openapi_3_1(app_and_document: tuple[Any, dict[str, Any]]) -> None:
    _, document = app_and_document
    jsonschema.Draft202012Validator(OPENAPI_31).validate(document)
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_routes_that_need_a_key_say_so_and_public_ones_do_not(
    app_and_document: tuple[Any, dict[str, Any]],
) -> None:
    _, document = app_and_document
    for path, item in document["paths"].items():
        for method, operation in item.items():
            keyed = path not in PUBLIC_PATHS
            assert ("security" in operation) is keyed, f"{method} {path}"
            assert {"401", "429"} <= set(operation["responses"]) or not keyed, f"{method} {path}"


def test_errors_answer_the_error_envelope_and_models_are_referenced(
    app_and_document: tuple[Any, dict[str, Any]],
) -> None:
    _, document = app_and_document
    jobs = document["paths"]["/v1/jobs"]["post"]
    assert jobs["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobRequest"
    }
    assert jobs["responses"]["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
    error = document["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]
    assert set(chat["content"]) == {"application/json", "text/event-stream"}
    assert "ChatCompletionChunk" in document["components"]["schemas"]  # the streamed events' model


class _Body(BaseModel):
    text: str


class _Answer(BaseModel):
    count: int


def test_an_operation_renders_its_parameters_bodies_and_errors() -> None:
    @Operation(
        "Counts a thing's text",
        request=_Body,
        responses={201: Reply("counted", _Answer, stream=Events("a count", _Answer), headers={"X-Id": "id"})},
        errors=(404,),
        params=(Param("limit", {"type": "integer"}),),
    )
    async def count(request: Request) -> Response:
        return Response()

    document = build_spec([Route("/things/{thing_id}", count, methods=["POST"])], "1")
    operation = document["paths"]["/things/{thing_id}"]["post"]
    assert [(p["name"], p["in"]) for p in operation["parameters"]] == [
        ("thing_id", "path"),
        ("limit", "query"),
    ]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/_Body"
    }
    created = operation["responses"]["201"]
    assert created["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/_Answer"}
    assert created["content"]["text/event-stream"]["schema"]["required"] == ["data"]
    assert created["headers"]["X-Id"]["description"] == "id"
    assert set(operation["responses"]) == {"201", "404", "401", "429"}
    assert {"_Body", "_Answer", "Error"} <= set(document["components"]["schemas"])


def test_a_route_without_an_operation_is_refused() -> None:
    async def undocumented(request: Request) -> Response:
        return Response()

    with pytest.raises(ValueError, match="undocumented"):
        build_spec([Route("/nowhere", undocumented, methods=["GET"])], "1")
