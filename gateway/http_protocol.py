"""uvicorn's httptools protocol with the limits a public endpoint needs: the size of a request's head,
and the time a client may take to send its head and its body (slowloris); and a way for a long response
to learn that its client left without a second task waiting in receive()."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from gateway.streaming.departure import DISCONNECT_EXTENSION
from gateway.streaming.direct import DIRECT_BODY_EXTENSION

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _ListEvent(asyncio.Event):
    """An asyncio.Event whose waiters are kept in a list (it has one waiter at most): an empty deque
    alone takes 0.6 KB, and uvicorn keeps two events for every open connection."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters = []  # type: ignore[assignment]


class _Pipeline(list[Any]):
    """uvicorn's queue of pipelined requests (appendleft, pop), in a list rather than a 0.7 KB deque:
    clients rarely pipeline, and every open connection has a queue."""

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


class DirectBody:
    """DIRECT_BODY_EXTENSION (see gateway.streaming.direct.DirectBody): a started response's body chunks
    written to the connection as uvicorn's own `send` writes them, without the ASGI send chain."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def write(self, data: bytes) -> bool:
        cycle = self._cycle
        if cycle.disconnected:
            return True  # the departure is on its way to the request's task
        if cycle.response_complete or not cycle.chunked_encoding:
            raise RuntimeError("a direct body needs a started response with a chunked body")
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return not cycle.flow.write_paused

    async def drain(self) -> None:
        if not self._cycle.disconnected:
            await self._cycle.flow.drain()


def _plain_response(status: int, message: str) -> bytes:
    body = message.encode()
    head = (
        f"HTTP/1.1 {status} ".encode()
        + _REASONS[status]
        + b"\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
    )
    return head + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """Answers 431 for a head past `max_head_bytes` (counted while it arrives, so a huge header is never
    buffered whole), and 408 to a client that has not sent its head within `head_timeout_s` of
    connecting or starting a request, or its body within `body_timeout_s` of its head."""

    # Slots, not the instance dict: uvicorn's protocol has 27 attributes, and a 31st turns each
    # connection's dict from a 0.3 KB shared-key dict into a 1.6 KB one of its own.
    __slots__ = ("_disconnect_callbacks", "_head_bytes", "_in_head", "_lost", "_rejected", "_timer")

    max_head_bytes = 16_384
    head_timeout_s = 10.0
    body_timeout_s = 30.0
    on_reject: Callable[[str], None] = staticmethod(lambda reason: None)

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._in_head = True
        self._head_bytes = 0
        self._rejected = False
        self._timer: asyncio.TimerHandle | None = None
        self._lost = False
        self._disconnect_callbacks: list[Callable[[], None]] = []
        self.pipeline = _Pipeline()  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        writable = self.flow._is_writable_event = _ListEvent()
        writable.set()  # as uvicorn's flow control starts
        self._arm(self.head_timeout_s, "the request head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        self._lost = True
        callbacks, self._disconnect_callbacks = self._disconnect_callbacks, []
        for callback in callbacks:
            callback()

    def watch_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """The DISCONNECT_EXTENSION of this connection's requests."""
        if self._lost:
            return self.loop.call_soon(callback).cancel  # a watch stopped before its turn calls nothing
        self._disconnect_callbacks.append(callback)

        def unwatch() -> None:
            with contextlib.suppress(ValueError):
                self._disconnect_callbacks.remove(callback)

        return unwatch

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes and not self._rejected:
            self._reject(431, "header_too_large", f"request head larger than {self.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # a new request on a kept-alive connection
            self._in_head = True
            self._head_bytes = 0
            self._arm(self.head_timeout_s, "the request head")

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        self._in_head = False
        if size > self.max_head_bytes:
            self._reject(431, "header_too_large", f"request head larger than {self.max_head_bytes} bytes")
            return
        self._arm(self.body_timeout_s, "the request body")
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
        extensions[DISCONNECT_EXTENSION] = {"watch": self.watch_disconnect}  # see gateway.streaming.departure
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not None and self.cycle is not previous:  # a new request: its task has not run yet
            self.cycle.message_event = _ListEvent()
            extensions[DIRECT_BODY_EXTENSION] = DirectBody(self.cycle)

    def on_body(self, body: bytes) -> None:
        if not self._rejected:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        if not self._rejected:
            super().on_message_complete()

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._timed_out, what, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self, what: str, seconds: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._head_bytes == 0 and self.cycle is None:
            self.on_reject("idle_connection")  # connected and sent nothing
            self._rejected = True
            self.transport.close()
            return
        self._reject(408, "read_timeout", f"{what} was not received within {seconds:g} s")

    def _reject(self, status: int, reason: str, message: str) -> None:
        self._rejected = True
        self._disarm()
        self.on_reject(reason)
        cycle = self.cycle
        if cycle is not None and cycle.response_started:  # answered already: nothing but closing is left
            self.transport.close()
            return
        if cycle is not None:
            cycle.disconnected = True  # the app sees http.disconnect and its answer is dropped
            cycle.message_event.set()
        self.transport.write(_plain_response(status, message))
        self.transport.close()


def guarded_protocol(
    max_head_bytes: int, head_timeout_s: float, body_timeout_s: float, on_reject: Callable[[str], None]
) -> type[GuardedHttpProtocol]:
    """The protocol class to give uvicorn (`http=`), with these limits."""
    return type(
        "GatewayHttpProtocol",
        (GuardedHttpProtocol,),
        {
            "max_head_bytes": max_head_bytes,
            "head_timeout_s": head_timeout_s,
            "body_timeout_s": body_timeout_s,
            "on_reject": staticmethod(on_reject),
        },
    )
