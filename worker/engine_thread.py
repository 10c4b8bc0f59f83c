"""The event loop's side of an engine whose own thread owns the model: requests, cancels, a restart and
the stop go to that thread through one command queue (OrtEngine, BatchingEngine)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable

from worker.engine import GenerationRequest, GenerationStream


class EngineThread:
    """Subclasses make these in __init__, then start the thread, which drains `_commands`: ("submit",
    streams), ("cancel", [stream]), ("restart", []) answering `_restarted`, and ("stop", [])."""

    _commands: queue.SimpleQueue[tuple[str, list[GenerationStream]]]
    _thread: threading.Thread
    _event_loop: asyncio.AbstractEventLoop | None
    _restarted: concurrent.futures.Future[None] | None
    on_failure: Callable[[str], None] | None

    def submit(self, requests: list[GenerationRequest]) -> list[GenerationStream]:
        loop = self._event_loop = asyncio.get_running_loop()
        streams = [GenerationStream(request=request, loop=loop) for request in requests]
        self._commands.put(("submit", streams))
        return streams

    def cancel(self, stream: GenerationStream) -> None:
        stream.cancel_requested = True
        self._commands.put(("cancel", [stream]))

    def close(self) -> None:
        self._commands.put(("stop", []))
        self._thread.join(timeout=10)

    def _tell_failure(self, cause: str) -> None:
        """From the engine's thread: the engine failed and can run nothing more (on_failure, in the event
        loop)."""
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self._report_failure, cause)

    def _report_failure(self, cause: str) -> None:
        if self.on_failure is not None:
            self.on_failure(cause)

    async def restart(self) -> None:
        """A fresh engine on the same model, after a failure (on_failure); raises when none can be made."""
        restarted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._restarted = restarted
        self._commands.put(("restart", []))
        await asyncio.wrap_future(restarted)
