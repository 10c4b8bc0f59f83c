"""The frontend's side: `EngineCoreClient` is the worker's `Engine` when the engine runs in an engine-core
process. Requests cross as commands, each wake-up's steps come back as arrays and become the rows'
updates in one pass, on the worker's event loop (no engine thread in this process, no cross-thread call
per row).

Where the core comes from is the launcher's business: `SpawnedCore` starts the worker's own core as its
child (one frontend), `SharedCore` connects to a core serving several frontends at a socket path. When the
core goes (it died, or its engine failed), every row still open ends `lost`, `on_failure` tells the
worker, whose jobs resume as after a worker's death, and `restart` brings a core back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from common.startup import CannotStart
from worker.core.channel import Frames, FrontendEnd, channel_pair, read_available
from worker.core.commands import Cancel, Command, Stop, Submit
from worker.core.facts import CoreFacts
from worker.core.step_wire import FINISHES, Step
from worker.core.updates import ENGINE_STATS, plain_step, unpack
from worker.engine import EngineUpdate, Finish, GenerationRequest, GenerationStream
from worker.engines.batcher.counters import BatcherCounters

logger = logging.getLogger("worker.core")

ROW_IDS = 2**31  # row ids are int32 on the wire
_POLL_S = 0.5


class CoreGone(ConnectionError):
    pass


class CoreLauncher(Protocol):
    def connect(self) -> tuple[socket.socket, CoreFacts]:
        """A connected socket to a core and the facts it sent (blocking)."""
        ...

    def gone(self) -> str:
        """Why the core is gone, as well as it can tell."""
        ...

    def close(self) -> None: ...


def read_facts(sock: socket.socket, timeout_s: float, alive: Callable[[], str | None]) -> CoreFacts:
    """The facts frame a core sends first; CoreGone when `alive` names a reason it stopped, the socket
    closes, or nothing comes within `timeout_s`."""
    frames = Frames()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], _POLL_S)
        if readable:
            got, closed = read_available(sock, frames)
            if got:
                return CoreFacts.decode(got[0])
            if closed:
                raise CoreGone(alive() or "the engine core closed its socket before it was ready")
        elif (reason := alive()) is not None:
            raise CoreGone(reason)
    raise CoreGone(f"the engine core sent nothing within {timeout_s:.0f} s")


class SpawnedCore:
    """Starts the worker's own engine core, `python -m worker.core --fd N`, with `args`."""

    def __init__(self, args: list[str], start_timeout_s: float) -> None:
        self.args = args
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def connect(self) -> tuple[socket.socket, CoreFacts]:
        self.close()
        ours, theirs = channel_pair()
        fd = theirs.fileno()
        # A session of its own: a Ctrl-C at the terminal reaches the worker, which drains, and not the
        # core under it; the core ends when the worker's end of the socket closes.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "worker.core", "--fd", str(fd), *self.args],
            pass_fds=(fd,),
            start_new_session=True,
        )
        theirs.close()
        try:
            facts = read_facts(ours, self.start_timeout_s, self._exited)
        except CoreGone:
            ours.close()
            raise
        logger.info("engine core started (pid %d)", self.process.pid)
        return ours, facts

    def _exited(self) -> str | None:
        process = self.process
        if process is None or process.poll() is None:
            return None
        return f"the engine core (pid {process.pid}) exited with status {process.returncode}"

    def gone(self) -> str:
        process = self.process
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=2)
        return self._exited() or "the engine core closed its socket"

    def close(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class SharedCore:
    """Connects to an engine core serving several frontends at a Unix socket path (`python -m worker.core
    --socket PATH`), waiting up to `wait_s` for one to listen there (its supervisor may be starting it)."""

    def __init__(self, path: Path, wait_s: float) -> None:
        self.path = path
        self.wait_s = wait_s

    def connect(self) -> tuple[socket.socket, CoreFacts]:
        deadline = time.monotonic() + self.wait_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.path))
                facts = read_facts(sock, self.wait_s, lambda: None)
            except (OSError, CoreGone) as e:
                sock.close()
                if time.monotonic() >= deadline:
                    raise CoreGone(
                        f"no engine core answered at {self.path} within {self.wait_s:.0f} s ({e})"
                    ) from e
                time.sleep(_POLL_S)
                continue
            logger.info("attached to the engine core at %s (pid %d)", self.path, facts.core_pid)
            return sock, facts

    def gone(self) -> str:
        return f"the engine core at {self.path} closed its socket"

    def close(self) -> None:
        pass


@dataclass
class RowStream(GenerationStream):
    row: int = -1  # its row id on the crossing


class EngineCoreClient:
    """Implements worker.engine.Engine over the crossing to an engine core."""

    def __init__(self, launcher: CoreLauncher) -> None:
        self._launcher = launcher
        try:
            sock, facts = launcher.connect()
        except CoreGone as e:
            raise CannotStart(str(e)) from e
        self._sock: socket.socket | None = sock
        self.capacity = facts.capacity
        self._take_facts(facts)
        self._end: FrontendEnd | None = None
        self._streams: dict[int, RowStream] = {}
        self._next_row = 0
        self._failed: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        # The core's batcher's figures as of its last step that carried them (None: not a batcher).
        self.counters: BatcherCounters | None = None
        self._stats: Mapping[str, Any] = {}

    def _take_facts(self, facts: CoreFacts) -> None:
        self.facts = facts
        self.context_length = facts.context_length
        self.continuous_batching = facts.continuous_batching
        self.handles_stop_strings = facts.handles_stop_strings
        self.exposes_logits = facts.exposes_logits
        self.replays_guidance = facts.replays_guidance
        self.closes_documents = facts.closes_documents
        self.prefix_block_tokens = facts.prefix_block_tokens
        self.eos_token_ids = frozenset(facts.eos_token_ids)
        self.kv_budget_tokens = facts.kv_budget_tokens

    # What the worker's metrics read of ortfleet's batcher, as the core last sent it.

    def rows(self) -> tuple[int, int, int]:
        waiting, prefilling, decoding = self._stats.get("rows", (0, 0, 0))
        return waiting, prefilling, decoding

    @property
    def kv_tokens_reserved(self) -> int:
        return int(self._stats.get("kv_tokens_reserved", 0))

    @property
    def prefix_cache_tokens(self) -> int:
        return int(self._stats.get("prefix_cache_tokens", 0))

    def _end_on(self, loop: asyncio.AbstractEventLoop) -> FrontendEnd:
        if self._end is None:
            assert self._sock is not None
            self._end = FrontendEnd(self._sock, loop, self._on_steps, self._on_closed)
        return self._end

    def submit(self, requests: list[GenerationRequest]) -> list[GenerationStream]:
        loop = asyncio.get_running_loop()
        streams: list[GenerationStream] = []
        end = None if self._failed is not None else self._end_on(loop)
        submits: list[Command] = []
        for request in requests:
            stream = RowStream(request=request, loop=loop, row=self._next_row)
            self._next_row = (self._next_row + 1) % ROW_IDS
            streams.append(stream)
            if end is None:
                loop.call_soon(stream.updates.put_nowait, EngineUpdate([], Finish.lost, self._failed))
                continue
            self._streams[stream.row] = stream
            submits.append(Submit.of(stream.row, request))
        if end is not None:
            end.send_all(submits)  # together: a static batch starts with all of them
        return streams

    def cancel(self, stream: GenerationStream) -> None:
        stream.cancel_requested = True
        if isinstance(stream, RowStream) and stream.row in self._streams and self._end is not None:
            self._end.send(Cancel(stream.row))

    def _on_steps(self, steps: list[Step]) -> None:
        streams = self._streams
        for step in steps:
            stats = step.notes.get(ENGINE_STATS) if step.notes else None
            if stats is not None:
                self._stats = stats
                self.counters = BatcherCounters(**stats["counters"])
            if plain_step(step):  # a token for each row, nothing rare: no generator, no slicing
                running = step.running
                for row, token, code in zip(
                    step.row_ids.tolist(), step.tokens.tolist(), step.finish.tolist(), strict=True
                ):
                    stream = streams.get(row)
                    if stream is None:
                        continue
                    if code:
                        del streams[row]
                    stream.updates.put_nowait(EngineUpdate([token], FINISHES[code], None, running))
                continue
            for row, update in unpack(step):
                stream = streams.get(row)
                if stream is None:
                    continue
                if update.finish is not None:
                    del streams[row]
                stream.updates.put_nowait(update)

    def _on_closed(self) -> None:
        self._end = None
        self._sock = None
        cause = self._launcher.gone()
        self._failed = cause
        lost, self._streams = self._streams, {}
        for stream in lost.values():
            stream.updates.put_nowait(EngineUpdate([], Finish.lost, cause))
        logger.error("%s: %d row(s) lost", cause, len(lost))
        if self.on_failure is not None:
            self.on_failure(cause)

    def close(self) -> None:
        end, self._end = self._end, None
        if end is not None:
            end.send(Stop())
            end.close()
        elif self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None
        self._launcher.close()

    async def restart(self) -> None:
        """A core again after the last one went; raises when none answers."""
        if self._failed is None:
            return
        sock, facts = await asyncio.to_thread(self._launcher.connect)  # it reaps the last one first
        if facts.capacity < self.capacity or facts.context_length != self.context_length:
            logger.warning("the new engine core has %d rows (%d before)", facts.capacity, self.capacity)
            self.capacity = min(self.capacity, facts.capacity)
        self._take_facts(facts)
        self._sock = sock
        self._failed = None
