"""The engine-core process: one engine (ortfleet's batcher, og.Engine or the fake one) and the frontends
that feed it. It runs the engine and nothing else: no Redis, no JSON of jobs, no detokenizing. Each
frontend is a worker process of the fleet with its share of the engine's rows; its commands arrive on
its socket, and the updates of its rows go back once per wake-up of the core's loop as one `Step`.

A frontend that leaves (it stopped, or died) has its rows cancelled; the others go on. When the engine
fails for good, the core ends every row (`lost`, as the engine reports them) and exits: its frontends see
the crossing close and resume their jobs, as after a worker's death, and start or wait for a new core."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from worker.core.channel import Frames, Outbox, frame, read_available
from worker.core.commands import Cancel, CommandDecodeError, Stop, Submit, decode_command
from worker.core.facts import CoreFacts, shares
from worker.core.step_wire import encode_step
from worker.core.updates import ENGINE_STATS, pack
from worker.engine import Engine, EngineUpdate, GenerationRequest, GenerationStream

logger = logging.getLogger("worker.core")

EXIT_ENGINE_FAILED = 3  # the engine failed for good: a new core loads it again
STATS_INTERVAL_S = 0.1
MAX_OUTBOX_BYTES = 1 << 28  # steps a frontend has not taken: past this it is dropped, stalled or not


class FrontendLink:
    """One connected frontend: its socket, its rows, the updates waiting for the next flush and the bytes
    its socket has not taken yet.

    Sends never block the core: what the socket cannot take waits in `outbox` and goes when it can. A
    frontend that takes nothing for the core's stall limit (paused, or hung) while steps wait for it is
    dropped, as if it had died, so that it cannot hold back the engine and the other frontends."""

    def __init__(self, core: EngineCore, sock: socket.socket, slot: int) -> None:
        self.core = core
        self.sock = sock
        self.slot = slot  # which share of the rows it holds
        self.rows: dict[int, GenerationStream] = {}
        self.frames = Frames()
        self.pending: list[tuple[int, EngineUpdate]] = []
        self.steps = 0
        self.gone = False
        self.stats_sent = 0.0  # when it was last sent the engine's figures (time.monotonic())
        self.outbox = Outbox(sock, core.loop, functools.partial(core.leave, self))

    def take(self, row: int, update: EngineUpdate) -> None:
        if self.gone:
            return
        if not self.pending:
            self.core.loop.call_soon(self.flush)
        self.pending.append((row, update))
        if update.finish is not None:
            self.rows.pop(row, None)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if not pending or self.gone:
            return
        self.steps += 1
        step = pack(self.steps, pending)
        stats = self.core.stats_due(self, any(update.finish is not None for _, update in pending))
        if stats is not None:
            step = replace(step, notes={**step.notes, ENGINE_STATS: stats})
        behind = bool(self.outbox)
        self.outbox.write(frame(encode_step(step)))
        if behind:
            self._check_stall()

    def _check_stall(self) -> None:
        stalled = time.monotonic() - self.outbox.stalled_since
        if stalled > self.core.stall_limit_s or len(self.outbox) > MAX_OUTBOX_BYTES:
            logger.error(
                "frontend %d took nothing for %.0f s with %d bytes of steps waiting: dropped",
                self.slot + 1,
                stalled,
                len(self.outbox),
            )
            self.core.leave(self)


class EngineCore:
    """Serves one engine to up to `frontends` frontends, on sockets handed to `attach`."""

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        *,
        frontends: int,
        device: str,
        kind: str,
        model_dir: str,
        fingerprint: str,
        on_empty: Callable[[], None] | None = None,
        stall_limit_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.stall_limit_s = stall_limit_s
        self.loop = loop
        self.frontends = frontends
        self.device = device
        self.kind = kind
        self.model_dir = model_dir
        self.fingerprint = fingerprint
        self.on_empty = on_empty  # called when the last frontend has left
        self.shares = shares(engine.capacity, frontends)
        self.links: dict[int, FrontendLink] = {}  # by slot
        self.failed = asyncio.Event()
        engine.on_failure = self._engine_failed

    def stats_due(self, link: FrontendLink, finished: bool) -> dict[str, Any] | None:
        """The engine's figures for the link's next step (ortfleet's batcher's, for the frontend's
        metrics), at most every STATS_INTERVAL_S, and with every step where a row ended."""
        counters = getattr(self.engine, "counters", None)
        now = time.monotonic()
        if counters is None or (not finished and now - link.stats_sent < STATS_INTERVAL_S):
            return None
        link.stats_sent = now
        engine: Any = self.engine
        return {
            "counters": asdict(counters),
            "rows": list(engine.rows()),
            "kv_tokens_reserved": engine.kv_tokens_reserved,
            "prefix_cache_tokens": engine.prefix_cache_tokens,
        }

    def attach(self, sock: socket.socket) -> bool:
        """Takes a frontend on `sock` (sends it the facts); False when every share is taken."""
        free = [slot for slot in range(self.frontends) if slot not in self.links]
        if not free or self.failed.is_set():
            sock.close()
            return False
        link = FrontendLink(self, sock, free[0])
        self.links[link.slot] = link
        facts = CoreFacts.of(
            self.engine,
            self.shares[link.slot],
            device=self.device,
            kind=self.kind,
            core_pid=os.getpid(),
            frontends=self.frontends,
            model_dir=self.model_dir,
            fingerprint=self.fingerprint,
        )
        sock.sendall(frame(facts.encode()))  # before any step: a few hundred bytes
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._readable, link)
        logger.info("frontend %d of %d attached (%d rows)", link.slot + 1, self.frontends, facts.capacity)
        return True

    def _readable(self, link: FrontendLink) -> None:
        frames, closed = read_available(link.sock, link.frames)
        submits: list[tuple[int, GenerationRequest]] = []
        for payload in frames:
            try:
                command = decode_command(payload)
            except (CommandDecodeError, ValueError, EOFError) as e:
                logger.error("frontend %d sent a malformed command (%s); it is dropped", link.slot + 1, e)
                closed = True
                break
            if isinstance(command, Submit):
                submits.append((command.row_id, command.request_with_prompt()))
            elif isinstance(command, Cancel):
                self._start(link, submits)
                submits = []
                stream = link.rows.get(command.row_id)
                if stream is not None:
                    self.engine.cancel(stream)
            elif isinstance(command, Stop):
                closed = True
                break
        self._start(link, submits)
        if closed:
            self.leave(link)

    def _start(self, link: FrontendLink, submits: list[tuple[int, GenerationRequest]]) -> None:
        if not submits:
            return
        streams = self.engine.submit([request for _, request in submits])
        for (row, _), stream in zip(submits, streams, strict=True):
            link.rows[row] = stream
            stream.updates.consume(functools.partial(link.take, row))

    def leave(self, link: FrontendLink) -> None:
        """The frontend has gone: its rows are cancelled, its share is free for the next one."""
        if link.gone:
            return
        link.gone = True
        self.loop.remove_reader(link.sock.fileno())
        link.outbox.close()
        link.sock.close()
        for stream in link.rows.values():
            self.engine.cancel(stream)
        cancelled = len(link.rows)
        link.rows.clear()
        del self.links[link.slot]
        logger.info("frontend %d left (%d rows cancelled)", link.slot + 1, cancelled)
        if not self.links and self.on_empty is not None:
            self.on_empty()

    def _engine_failed(self, cause: str) -> None:
        logger.critical("the engine failed (%s): the core ends its rows and exits", cause)
        self.failed.set()

    def close(self) -> None:
        for link in list(self.links.values()):
            link.flush()
            if not link.gone:
                link.outbox.drain(timeout_s=1.0)  # its last steps, a second at most
            self.leave(link)
        self.engine.close()


async def serve_socket(core: EngineCore, sock: socket.socket) -> int:
    """Serves the one frontend that spawned this core on `sock`, until it leaves; the exit status."""
    done = asyncio.Event()
    core.on_empty = done.set
    core.attach(sock)
    return await _until(core, done)


async def serve_path(core: EngineCore, path: Path) -> int:
    """Serves frontends that connect to the Unix socket at `path`, until a signal stops the core (and
    its frontends have left) or the engine fails; the exit status."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a core that died before it could remove it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(core.frontends)
    listener.setblocking(False)
    stopping = asyncio.Event()
    done = asyncio.Event()

    def accept() -> None:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return
        if not core.attach(sock):
            logger.warning("a frontend was turned away: all %d shares are taken", core.frontends)

    def stop() -> None:
        if stopping.is_set() or not core.links:
            done.set()  # a second signal, or nobody to wait for
        stopping.set()
        core.loop.remove_reader(listener.fileno())
        logger.info("stopping once its %d frontend(s) have left", len(core.links))

    core.on_empty = lambda: done.set() if stopping.is_set() else None
    core.loop.add_reader(listener.fileno(), accept)
    for sig in (signal.SIGTERM, signal.SIGINT):
        core.loop.add_signal_handler(sig, stop)
    logger.info(
        "engine core (%s on %s) listens on %s for %d frontend(s)",
        core.kind,
        core.device,
        path,
        core.frontends,
    )
    try:
        return await _until(core, done)
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def _until(core: EngineCore, done: asyncio.Event) -> int:
    failed = asyncio.ensure_future(core.failed.wait())
    finished = asyncio.ensure_future(done.wait())
    await asyncio.wait([failed, finished], return_when=asyncio.FIRST_COMPLETED)
    failed.cancel()
    finished.cancel()
    await asyncio.sleep(0)  # the updates the failure delivered are flushed first
    core.close()
    return EXIT_ENGINE_FAILED if core.failed.is_set() else 0
