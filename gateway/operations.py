"""A route's operation in `GET /openapi.json`, declared on its handler: what it does, what it reads
(parameters, the request body's model) and what it answers (the response models, the error statuses).
`gateway/openapi.py` renders the document from these and the app's routes.

    @Operation("A job", responses={200: Reply("the job", JobView)}, errors=(404,))
    async def get_job(request: Request) -> Response: ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

Schema = dict[str, Any]
Body = type[BaseModel] | Schema  # a JSON body: its model, or the schema of a body no model describes

STRING: Schema = {"type": "string"}
OBJECT: Schema = {"type": "object"}

_ATTRIBUTE = "openapi_operation"

Handler = TypeVar("Handler", bound=Callable[..., Any])


@dataclass(frozen=True)
class Param:
    """A query or header parameter (path parameters come from the route's path)."""

    name: str
    schema: Schema = field(default_factory=lambda: dict(STRING))
    where: Literal["query", "header"] = "query"


def header(name: str) -> Param:
    return Param(name, where="header")


@dataclass(frozen=True)
class Events:
    """A `text/event-stream` answer: each event's `data` described; `model` is the JSON that `data` holds
    (listed in the document's schemas), `named` when events carry an `event:` field."""

    data: str
    model: type[BaseModel] | None = None
    named: bool = False
    about: str | None = None


@dataclass(frozen=True)
class Reply:
    """One status's answer: `body` in `media_type`, and (`stream`) an event stream instead on request."""

    description: str
    body: Body | None = None
    media_type: str = "application/json"
    stream: Events | Schema | None = None
    headers: Mapping[str, str] = field(default_factory=dict)  # name: description (a string value)


@dataclass(frozen=True)
class Operation:
    """The operation of the handler it decorates. `errors` answer the error envelope; a route that needs
    a key also answers 401 and 429 (added by the renderer)."""

    summary: str
    responses: Mapping[int, Reply] = field(default_factory=lambda: {200: Reply("ok")})
    request: Body | None = None
    request_media_type: str = "application/json"
    errors: tuple[int, ...] = ()
    params: tuple[Param, ...] = ()

    def __call__(self, handler: Handler) -> Handler:
        setattr(handler, _ATTRIBUTE, self)
        return handler


def operation_of(handler: object) -> Operation | None:
    found = getattr(handler, _ATTRIBUTE, None)
    return found if isinstance(found, Operation) else None


def page_of(items: str) -> Schema:
    """OpenAI's list object whose items no model describes."""
    return {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": OBJECT}},
        "description": f"a page of {items}",
    }
