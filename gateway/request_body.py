"""Reading a request's JSON body safely: bounded nesting and numbers, valid Unicode, then the model."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from common.error_codes import ErrorCode
from gateway.errors import ApiError, ClientGone, validation_error

Model = TypeVar("Model", bound=BaseModel)

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class JsonLimits:
    max_depth: int = 32
    max_number_digits: int = 40


class BodyRejected(ApiError):
    """A body refused before validation; `reason` labels the rejection in the metrics."""

    def __init__(self, reason: str, message: str, param: str | None = None) -> None:
        super().__init__(400, message, param=param, code=ErrorCode(reason))
        self.reason = reason


def load_json(raw: bytes, limits: JsonLimits) -> Any:
    """The parsed body; BodyRejected for broken JSON, NaN or Infinity, numbers too long, nesting too
    deep, or text that is not valid Unicode (a lone surrogate)."""

    most = limits.max_number_digits

    def too_long(text: str) -> bool:
        return len(text) > most and len(text) - sum(text.count(c) for c in "-+.eE") > most

    def integer(text: str) -> int:
        if too_long(text):
            raise BodyRejected("number_too_long", f"the request body has a number of over {most} digits")
        return int(text)

    def real(text: str) -> float:
        if too_long(text):
            raise BodyRejected("number_too_long", f"the request body has a number of over {most} digits")
        value = float(text)
        if math.isinf(value):
            raise BodyRejected("number_out_of_range", f"the request body has a number out of range: {text}")
        return value

    def constant(name: str) -> Any:
        raise BodyRejected("invalid_json", f"the request body is not valid JSON: {name} is not a JSON value")

    try:
        data = json.loads(raw, parse_int=integer, parse_float=real, parse_constant=constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyRejected("invalid_json", f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:  # the parser gives up at the interpreter's depth, in linear time
        raise _too_deep(limits) from e
    _check(data, limits)
    return data


def _too_deep(limits: JsonLimits) -> BodyRejected:
    return BodyRejected(
        "json_too_deep", f"the request body nests arrays and objects over {limits.max_depth} levels deep"
    )


def _check(data: Any, limits: JsonLimits) -> None:
    """Nesting depth and valid text, walked without recursion (the parser allows ~1000 levels)."""
    # Each entry: a value, its path as a linked (parent, key) pair, spelled out only for an error.
    stack: list[tuple[Any, Any, int]] = [(data, None, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                name = _spelled(path) or "body"
                raise BodyRejected(
                    "invalid_text",
                    f"{name}: contains a lone surrogate; text must be valid Unicode",
                    param=name,
                )
            continue
        if depth >= limits.max_depth:
            raise _too_deep(limits)
        # Empty arrays and objects need walking only where they would be one level too deep.
        last = depth + 1 >= limits.max_depth
        if isinstance(value, list):
            stack.extend(
                (v, (path, i), depth + 1)
                for i, v in enumerate(value)
                if isinstance(v, str) or (isinstance(v, list | dict) and (v or last))
            )
            continue
        for key, item in value.items():
            if _SURROGATE.search(key):
                at = _spelled((path, ascii(key)[1:-1]))
                raise BodyRejected("invalid_text", f"{at}: a field name contains a lone surrogate", param=at)
            if isinstance(item, str) or (isinstance(item, list | dict) and (item or last)):
                stack.append((item, (path, key), depth + 1))


def _spelled(path: Any) -> str:
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(str(key))
    return ".".join(reversed(parts))


def body_limits(request: Request) -> JsonLimits:
    settings = request.app.state.ortfleet.settings
    return JsonLimits(settings.max_json_depth, settings.max_number_digits)


async def parse_body(request: Request, model: type[Model], *, invalid_status: int = 422) -> Model:
    """The JSON body validated into `model`: 400 for a body that is not sound JSON, 422
    (`invalid_status`) naming the first bad field."""
    try:
        raw = await request.body()
    except ClientDisconnect as e:
        raise ClientGone from e
    try:
        data = load_json(raw, body_limits(request)) if raw else None
    except BodyRejected as e:
        request.app.state.ortfleet.metrics.rejected.labels(e.reason).inc()
        raise
    if not isinstance(data, dict):
        raise ApiError(invalid_status, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, invalid_status) from e
