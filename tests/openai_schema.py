"""Every answer of an OpenAI route checked against OpenAI's OpenAPI document (tests/openapi/openai.json).

`install` wraps the HTTP transports of httpx and httpx2 (the tests' clients and the SDK's) for the whole
session: the body of each answer from a route of the document (`/v1/chat/completions`, `/v1/responses/{id}`,
...) is validated as it is read, a JSON body once read to its end, an SSE stream event by event (so a stream
a test leaves early is checked as far as it went). Mismatches go to `report`; conftest fails the test that
saw them. Routes ortfleet adds (`/v1/jobs`, `/v1/fleet`, ...) are not in the document and are not checked.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry
from referencing.jsonschema import DRAFT202012

DOCUMENT = Path(__file__).parent / "openapi" / "openai.json"
BASE = "urn:openai"
ERROR = "ErrorResponse"
# The document gives completions no event-stream schema: OpenAI streams CreateCompletionResponse objects
# whose choices have `finish_reason: null` until their last chunk (COMPLETION_CHUNK, made in __init__).
COMPLETION_CHUNK = "x-CompletionChunk"
STREAMS = {
    "/chat/completions": "CreateChatCompletionStreamResponse",
    "/completions": COMPLETION_CHUNK,
    "/responses": "ResponseStreamEvent",
    "/responses/{response_id}": "ResponseStreamEvent",
}


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true`, left in places of this 3.1 document, as JSON Schema says it."""
    if isinstance(node, list):
        return [_nullable(value) for value in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    if node.pop("nullable", False):
        if "enum" in node:
            node["enum"] = [*node["enum"], None]
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        elif "type" not in node:
            return {"anyOf": [node, {"type": "null"}]}
    return node


class OpenAISchema:
    def __init__(self, document: Path = DOCUMENT) -> None:
        self.document: dict[str, Any] = _nullable(json.loads(document.read_text()))
        schemas = self.document["components"]["schemas"]
        # An echoed prompt's first token has no log-probability: null, as OpenAI's legacy completions
        # and vLLM answer it (the document types every entry a number and an object).
        choice = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]
        listed = choice["logprobs"]["anyOf"][0]["properties"]
        for field in ("token_logprobs", "top_logprobs"):
            listed[field]["items"] = {"anyOf": [listed[field]["items"], {"type": "null"}]}
        chunk = schemas[COMPLETION_CHUNK] = copy.deepcopy(schemas["CreateCompletionResponse"])
        reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
        reason["type"], reason["enum"] = [reason["type"], "null"], [*reason["enum"], None]
        # An empty page of a list has no first
        # or last id, and says so with null (the document wants strings; the SDK reads neither).
        ends = {"first_id": {"type": "string"}, "last_id": {"type": "string"}}
        for listing in ("ListFilesResponse", "ListBatchesResponse"):
            for end in ends:
                schemas[listing]["properties"][end]["type"] = ["string", "null"]
            schemas[listing]["if"] = {"properties": {"data": {"minItems": 1}}}
            schemas[listing]["then"] = {"properties": ends}
        self._registry: Registry[Any] = Registry().with_resource(
            BASE, DRAFT202012.create_resource(self.document)
        )
        self._routes = [
            (re.compile("^/v1" + re.sub(r"\{[^}]+\}", "[^/]+", route) + "$"), route)
            for route in self.document["paths"]
        ]
        self.validator = cache(self._validator)

    def schema(self, name: str) -> dict[str, Any]:
        return self.document["components"]["schemas"][name]  # type: ignore[no-any-return]

    def _validator(self, name: str) -> Draft202012Validator:
        return Draft202012Validator({"$ref": f"{BASE}#/components/schemas/{name}"}, registry=self._registry)

    def route(self, path: str) -> str | None:
        return next((route for pattern, route in self._routes if pattern.match(path)), None)

    def answer_schema(self, method: str, route: str, status: int, content_type: str) -> str | None:
        """The schema of an answer's body (of each event of a stream), None where the document gives none."""
        if status >= 400:
            return ERROR if content_type.startswith("application/json") else None
        if content_type.startswith("text/event-stream"):
            return STREAMS.get(route)
        if not content_type.startswith("application/json"):
            return None
        operation = self.document["paths"][route].get(method.lower(), {})
        content = operation.get("responses", {}).get(str(status), {}).get("content", {})
        ref = content.get("application/json", {}).get("schema", {}).get("$ref", "")
        return ref.rsplit("/", 1)[-1] or None

    def member(self, name: str, body: Any) -> str:
        """Of a union told apart by `type` (a stream event), the member the body's type names; else name."""
        members = self.schema(name).get("anyOf") or self.schema(name).get("oneOf") or []
        kind = body.get("type") if isinstance(body, dict) else None
        for member in members:
            ref = member.get("$ref", "").rsplit("/", 1)[-1]
            types = self.schema(ref).get("properties", {}).get("type", {}) if ref else {}
            if kind is not None and kind in types.get("enum", [types.get("const")]):
                return str(ref)
        return name

    def mismatch(self, name: str, body: Any) -> str | None:
        """None when body validates against the schema; else the JSON pointer and message of the mismatch."""
        name = self.member(name, body)
        error = best_match(self.validator(name).iter_errors(body))
        if error is None:
            return None
        pointer = "".join(f"/{part}" for part in error.absolute_path)
        return f"{name} at {pointer or '/'}: {error.message[:400]}"


class _Answer:
    """One answer's body as it is read, checked against its schema; mismatches go to `report`."""

    def __init__(
        self, schema: OpenAISchema, name: str, where: str, stream: bool, report: Callable[[str], None]
    ) -> None:
        self.schema, self.name, self.where, self.stream, self.report = schema, name, where, stream, report
        self.buffer = b""
        self.closed = False

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        if not self.stream:
            return
        while (end := _event_end(self.buffer)) is not None:
            event, self.buffer = self.buffer[:end], self.buffer[end:].lstrip(b"\r\n")
            self._event(event)

    def _event(self, event: bytes) -> None:
        data = "\n".join(
            line[5:].removeprefix(" ") for line in event.decode().splitlines() if line.startswith("data:")
        )
        if not data or data == "[DONE]":
            return
        try:
            body = json.loads(data)
        except ValueError:
            self.report(f"{self.where}: an event's data is not JSON: {data[:200]!r}")
            return
        # Chat and completions streams report a late failure as an error envelope, as OpenAI does.
        name = ERROR if isinstance(body, dict) and "error" in body and "object" not in body else self.name
        self._check(name, body)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stream or not self.buffer:
            return
        try:
            body = json.loads(self.buffer)
        except ValueError:
            self.report(f"{self.where}: the body is not JSON: {self.buffer[:200]!r}")
            return
        self._check(self.name, body)

    def _check(self, name: str, body: Any) -> None:
        if (problem := self.schema.mismatch(name, body)) is not None:
            self.report(f"{self.where}: {problem}\n  body: {json.dumps(body)[:600]}")


def _event_end(buffer: bytes) -> int | None:
    ends = [i for i in (buffer.find(b"\n\n"), buffer.find(b"\r\n\r\n")) if i >= 0]
    return min(ends) if ends else None


def _answer(
    schema: OpenAISchema, request: httpx.Request, response: httpx.Response, report: Callable[[str], None]
) -> _Answer | None:
    route = schema.route(request.url.path)
    if route is None or response.headers.get("content-encoding"):
        return None
    content_type = response.headers.get("content-type", "")
    name = schema.answer_schema(request.method, route, response.status_code, content_type)
    if name is None:
        return None
    where = f"{request.method} {request.url.path} {response.status_code}"
    return _Answer(schema, name, where, content_type.startswith("text/event-stream"), report)


def _wrap(http: ModuleType, schema: OpenAISchema, report: Callable[[str], None]) -> Callable[[], None]:
    """Wraps the HTTP transports of httpx (or of httpx2, its fork the openai SDK uses); returns the undo."""
    sync_send = http.HTTPTransport.handle_request
    async_send = http.AsyncHTTPTransport.handle_async_request

    class SyncBody(http.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, answer: _Answer) -> None:
            self.inner, self.answer = inner, answer

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self.inner:
                self.answer.feed(chunk)
                yield chunk
            self.answer.close()

        def close(self) -> None:
            self.inner.close()

    class AsyncBody(http.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, answer: _Answer) -> None:
            self.inner, self.answer = inner, answer

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self.inner:
                self.answer.feed(chunk)
                yield chunk
            self.answer.close()

        async def aclose(self) -> None:
            await self.inner.aclose()

    def handle_request(self: Any, request: Any) -> Any:
        response = sync_send(self, request)
        answer = _answer(schema, request, response, report)
        if answer is not None:
            response.stream = SyncBody(response.stream, answer)
        return response

    async def handle_async_request(self: Any, request: Any) -> Any:
        response = await async_send(self, request)
        answer = _answer(schema, request, response, report)
        if answer is not None:
            response.stream = AsyncBody(response.stream, answer)
        return response

    http.HTTPTransport.handle_request = handle_request
    http.AsyncHTTPTransport.handle_async_request = handle_async_request

    def undo() -> None:
        http.HTTPTransport.handle_request = sync_send
        http.AsyncHTTPTransport.handle_async_request = async_send

    return undo


def install(schema: OpenAISchema, report: Callable[[str], None]) -> Callable[[], None]:
    """Checks every answer read through the transports of httpx and httpx2 from now on; returns the undo."""
    undo = [_wrap(http, schema, report) for http in _clients()]

    def undo_all() -> None:
        for each in undo:
            each()

    return undo_all


def _clients() -> list[ModuleType]:
    modules = [httpx]
    try:
        import httpx2
    except ImportError:
        return modules
    return [*modules, httpx2]
