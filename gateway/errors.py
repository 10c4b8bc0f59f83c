"""The one error envelope (OpenAI's shape): produced by the exception handlers registered here, and
by the few places that answer before them or inside a stream (auth, an SSE error frame)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ValidationError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common.error_codes import ErrorCode

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
        code: ErrorCode | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class ClientGone(Exception):
    """The client went away before its request was read or answered: nothing to send, nothing to log."""


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left; nobody receives it


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: ErrorCode | None = None


class Error(BaseModel):
    """The error envelope (OpenAI's shape): the body of every error answer."""

    error: ErrorDetail


def envelope(
    status: int, message: str, param: str | None = None, code: ErrorCode | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    detail = ErrorDetail(message=message, type=kind, param=param, code=code)
    return Error(error=detail).model_dump(mode="json")


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
    if isinstance(exc, OutOfMemoryError):
        logger.warning("Redis refused a write on %s %s: %s", request.method, request.url.path, exc)
        return store_full_response(
            "the job store (Redis) is out of memory (maxmemory reached) and refuses writes; retry once it "
            "has room"
        )
    logger.warning("Redis unavailable on %s %s: %s", request.method, request.url.path, exc)
    if isinstance(exc, RedisTimeoutError):
        request.app.state.ortfleet.metrics.rejected.labels("store_timeout").inc()
        message, code = "the job store (Redis) did not answer in time; retry shortly", ErrorCode.store_timeout
    else:
        message, code = "the job store (Redis) is unavailable; retry shortly", ErrorCode.store_unavailable
    return JSONResponse(envelope(503, message, code=code), 503, {"Retry-After": "1"})


STORE_FULL_RETRY_S = 5


def store_full(message: str) -> ApiError:
    """503 store_full: Redis refuses writes for memory."""
    return ApiError(503, message, code=ErrorCode.store_full, headers={"Retry-After": str(STORE_FULL_RETRY_S)})


def store_full_response(message: str) -> JSONResponse:
    error = store_full(message)
    return JSONResponse(envelope(error.status, error.message, code=error.code), error.status, error.headers)


async def client_gone_handler(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(envelope(500, "internal error; see the gateway's log"), 500)
