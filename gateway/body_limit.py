from __future__ import annotations

import json
from collections.abc import Awaitable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import envelope


class BodySizeLimit:
    """Answers 413 for a request body past the limit, before the route reads it; `path_limits` gives
    some paths a limit of their own (file uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits or {}

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] != "http" or not _has_body(scope):
            # Nothing to count; and an event stream that stays open for hours holds no frame of ours.
            return self.app(scope, receive, send)
        return self._limited(scope, receive, send)

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.path_limits.get(scope["path"], self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(send, limit)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge:
            await self._reject(send, limit)

    async def _reject(self, send: Send, limit: int) -> None:
        body = json.dumps(envelope(413, f"request body is larger than {limit} bytes")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _has_body(scope: Scope) -> bool:
    """Whether the request has a body: HTTP/1.1 sends none without Content-Length or Transfer-Encoding."""
    return any(name in (b"content-length", b"transfer-encoding") for name, _ in scope["headers"])


class BodyTooLarge(Exception):
    pass
