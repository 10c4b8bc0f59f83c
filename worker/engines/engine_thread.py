"""An engine whose own thread owns the model (OrtEngine, BatchingEngine): requests, cancels, a restart and
the stop go to that thread through one command queue, which the thread drains between its steps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from worker.engine import EngineUpdate, Finish, GenerationRequest, GenerationStream, deliver_all

Updates = list[tuple[GenerationStream, EngineUpdate]]  # for deliver_all


class EngineThread(ABC):
    """Subclasses call __init__ first, then make their engine, then start `_thread`, which runs `_main`
    and drains `_commands` (`_drain_commands`): ("submit", streams), ("cancel", [stream]), ("restart", [])
    answering `_restarted`, and ("stop", [])."""

    def __init__(self, thread_name: str) -> None:
        self._commands: queue.SimpleQueue[tuple[str, list[GenerationStream]]] = queue.SimpleQueue()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._restarted: concurrent.futures.Future[None] | None = None
        self._failed: str | None = None  # the engine thread's: why the engine is unusable
        # Called in the event loop when the engine fails and can run nothing more (see restart).
        self.on_failure: Callable[[str], None] | None = None
        self._thread = threading.Thread(target=self._main, name=thread_name, daemon=True)

    # The event loop's side.

    def submit(self, requests: list[GenerationRequest]) -> list[GenerationStream]:
        loop = self._event_loop = asyncio.get_running_loop()
        streams = [GenerationStream(request=request, loop=loop) for request in requests]
        self._hand(streams)
        return streams

    def _hand(self, streams: list[GenerationStream]) -> None:
        """Hands submitted requests to the engine's thread (`_start` takes each), together."""
        self._commands.put(("submit", streams))

    def cancel(self, stream: GenerationStream) -> None:
        stream.cancel_requested = True
        self._commands.put(("cancel", [stream]))

    def close(self) -> None:
        self._commands.put(("stop", []))
        self._thread.join(timeout=10)

    async def restart(self) -> None:
        """A fresh engine on the same model, after a failure (on_failure); raises when none can be made."""
        restarted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._restarted = restarted
        self._commands.put(("restart", []))
        await asyncio.wrap_future(restarted)

    def _report_failure(self, cause: str) -> None:
        if self.on_failure is not None:
            self.on_failure(cause)

    # The engine's thread.

    @abstractmethod
    def _main(self) -> None: ...

    @abstractmethod
    def _start(self, stream: GenerationStream, updates: Updates) -> None:
        """Takes a submitted request (a refusal goes to `updates`)."""

    @abstractmethod
    def _cancel(self, stream: GenerationStream, updates: Updates) -> None: ...

    @abstractmethod
    def _renew(self) -> None:
        """Replaces the failed engine; raises when it cannot."""

    def _drain_commands(self, *, block: bool) -> bool:
        """Runs the waiting commands (blocking for the first while `block`); False once told to stop.
        Their updates reach the event loop in one wake-up."""
        try:
            command, streams = self._commands.get(block=block)
        except queue.Empty:
            return True
        updates: Updates = []
        while True:
            if command == "stop":
                deliver_all(updates)
                return False
            if command == "restart":
                self._restart()
            for stream in streams:
                if command == "submit" and self._failed:
                    updates.append((stream, EngineUpdate([], Finish.lost, self._failed)))
                elif command == "submit":
                    self._start(stream, updates)
                else:
                    self._cancel(stream, updates)
            try:
                command, streams = self._commands.get_nowait()
            except queue.Empty:
                deliver_all(updates)
                return True

    def _restart(self) -> None:
        restarted = self._restarted
        assert restarted is not None
        if self._failed is not None:  # else nothing to replace
            try:
                self._renew()
            except Exception as e:
                restarted.set_exception(e)
                return
            self._failed = None
        restarted.set_result(None)

    def _tell_failure(self, cause: str) -> None:
        """The engine failed and can run nothing more (on_failure, in the event loop)."""
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self._report_failure, cause)
