"""The one error envelope (OpenAI's shape), produced only by the handlers registered here."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def envelope(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def validation_error(error: ValidationError, status: int = 422) -> ApiError:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    return ApiError(status, f"{location}: {message}" if location else message, param=location)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse(envelope(exc.status, exc.message, exc.param, exc.code), exc.status, exc.headers)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = exc.detail if exc.status_code != 404 else f"no route {request.method} {request.url.path}"
    return JSONResponse(envelope(exc.status_code, str(message)), exc.status_code, exc.headers)


async def redis_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.warning("Redis unavailable on %s %s: %s", request.method, request.url.path, exc)
    body = envelope(503, "the job store (Redis) is unavailable; retry shortly", code="store_unavailable")
    return JSONResponse(body, 503, {"Retry-After": "1"})


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(envelope(500, "internal error; see the gateway's log"), 500)
