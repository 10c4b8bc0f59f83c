"""The gateway being told to stop (SIGTERM): what waits on a job hears it at once, before uvicorn's
graceful shutdown (5 s) runs out and cuts it.

A long-poll answers the job as it stands (gateway/jobs.py). An OpenAI call cannot be picked up again
elsewhere, so its jobs are cancelled: one not yet answering gets 503 `server_shutting_down` with
`Retry-After` (its client retries on another replica), an open stream ends with that error in band and
`[DONE]` (gateway/openai_api/streaming.py). The job API's streams are left to the cut: their clients
resume them on another replica with `Last-Event-ID`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from common.error_codes import ErrorCode
from gateway.errors import ApiError
from gateway.streaming.departure import CancelledOnDeparture

T = TypeVar("T")

SHUTTING_DOWN = "the gateway is shutting down; send the request again (to another replica)"
RETRY_AFTER_S = 1


class Stopping:
    """Set once, when the gateway is told to stop; `wait` for it, or `listen` with a callback."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._listeners: set[Callable[[], None]] = set()

    def set(self) -> None:
        self._event.set()
        listeners, self._listeners = self._listeners, set()
        for listener in listeners:
            listener()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()

    def listen(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Calls `listener` once, from the event loop, when the gateway is told to stop (soon, if it was
        already); returns the function that stops listening."""
        if self.is_set():
            return asyncio.get_running_loop().call_soon(listener).cancel
        self._listeners.add(listener)
        return lambda: self._listeners.discard(listener)


class GatewayStopping(Exception):
    """The gateway was told to stop while the request waited."""


async def unless_stopping(stopping: Stopping, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; GatewayStopping, with `work` cancelled, if the gateway is told to stop first."""
    if stopping.is_set():
        work.close()
        raise GatewayStopping
    with CancelledOnDeparture(stopping.listen):
        return await work
    raise GatewayStopping  # the block ended early: the gateway is stopping


def shutting_down(headers: dict[str, str]) -> ApiError:
    """503 for a request the stopping gateway will not answer; `Retry-After` for another replica."""
    retry = {**headers, "Retry-After": str(RETRY_AFTER_S)}
    return ApiError(503, SHUTTING_DOWN, code=ErrorCode.server_shutting_down, headers=retry)
