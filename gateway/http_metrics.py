from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.routing import BaseRoute, Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics

UNMATCHED = "unmatched"
# Clients choose the method: any other one is counted as OTHER, so they cannot grow the label set.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class HttpMetrics:
    """Counts requests by route template, method and status, times them, and tracks open SSE streams."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless a response starts: an exception escaped to the server error handler
        stream_route: str | None = None

        async def observed_send(message: Message) -> None:
            nonlocal status, stream_route
            if message["type"] == "http.response.start":
                status = message["status"]
                if _is_event_stream(message.get("headers", [])):
                    stream_route = route_template(scope)
                    self.metrics.sse_streams.labels(stream_route).inc()
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            if stream_route is not None:
                self.metrics.sse_streams.labels(stream_route).dec()
            route = stream_route or route_template(scope)
            method = scope["method"] if scope["method"] in METHODS else "OTHER"
            self.metrics.http_requests.labels(route, method, str(status)).inc()
            self.metrics.http_duration.labels(route, method).observe(time.perf_counter() - started)


def route_template(scope: Scope) -> str:
    """The path template of the route serving the request (`/v1/jobs/{job_id}`), never the raw path."""
    routes: list[BaseRoute] = getattr(scope.get("app"), "routes", [])
    return _match(routes, scope) or UNMATCHED


def _match(routes: list[BaseRoute], scope: Scope) -> str | None:
    partial: str | None = None
    for route in routes:
        match, child_scope = route.matches(scope)
        if match is Match.NONE:
            continue
        path: str | None
        if isinstance(route, Mount):
            inner = _match(route.routes, {**scope, **child_scope})
            path = route.path + inner if inner else None
        else:
            path = getattr(route, "path", None)
        if match is Match.FULL and path:
            return path
        partial = partial or path
    return partial


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
