"""Noticing that a client left while its request still waits or streams.

The gateway's own HTTP protocol (`gateway.http_protocol`) offers each request the scope extension
DISCONNECT_EXTENSION, `{"watch": watch}`: `watch(callback)` calls `callback` once, from the event loop,
when the client's connection closes (soon, if it is closed already), and returns the function that
stops the watch. A request then learns of the departure from a callback; without the extension (any
other server), a second task has to wait in `receive()` for `http.disconnect`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from starlette.requests import Request

from gateway.errors import ClientGone

DISCONNECT_EXTENSION = "ortfleet.disconnect"

T = TypeVar("T")

DisconnectWatch = Callable[[Callable[[], None]], Callable[[], None]]


def disconnect_watch(scope: Any) -> DisconnectWatch | None:
    """The request's DISCONNECT_EXTENSION, when its server offers one."""
    extension = scope.get("extensions", {}).get(DISCONNECT_EXTENSION)
    return None if extension is None else extension["watch"]


class CancelledOnDeparture:
    """Inside the block, a client that leaves cancels the current task; that cancellation ends at the
    block's edge, where `left` says whether it happened (code after the block runs on). A cancellation
    from anywhere else goes on as usual."""

    def __init__(self, watch: DisconnectWatch) -> None:
        self._watch = watch
        self._unwatch: Callable[[], None] = lambda: None
        self._task: asyncio.Task[Any] | None = None
        self.left = False

    def __enter__(self) -> CancelledOnDeparture:
        task = asyncio.current_task()
        assert task is not None, "CancelledOnDeparture needs a task"
        self._task = task
        self._unwatch = self._watch(self._client_left)
        return self

    def _client_left(self) -> None:
        self.left = True
        assert self._task is not None
        self._task.cancel()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> bool:
        self._unwatch()
        if not self.left:
            return False
        assert self._task is not None
        others = self._task.uncancel()  # the count of cancels still asked for, ours taken back
        return kind is asyncio.CancelledError and others == 0


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; ClientGone, with `work` cancelled, if the client disconnects first."""
    watch = disconnect_watch(request.scope)
    if watch is None:
        return await _racing_receive(request, work)
    with CancelledOnDeparture(watch):
        return await work
    raise ClientGone  # the block ended early: the client left


async def _racing_receive(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """until_disconnect behind a server without DISCONNECT_EXTENSION: a task waits in receive()."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    # Not awaited: a Redis read with a socket timeout may finish its round before it sees the cancel,
    # and the client is gone now, not then.
    task.add_done_callback(_retrieve)
    raise ClientGone


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
