"""The duplex channel between the engine core and one frontend: a Unix socketpair carrying frames, each a
4-byte little-endian length and its payload (an encoded step one way, a command the other).

A socketpair rather than `multiprocessing.connection`: a Connection can only take a frame with a
blocking read (on a non-blocking descriptor a partial frame raises midway), so draining every frame that
has arrived needs its `poll()`, which builds a selector per call, twice the cost a step of the socket's
one `recv` that takes everything there is. The frontend reads from its asyncio loop (`loop.add_reader`):
one wake-up hands every step that has arrived to one callback.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import time
from collections.abc import Callable

from worker.core.commands import Command, decode_command, encode_command
from worker.core.step_wire import Step, decode_step

LENGTH = struct.Struct("<I")
_CHUNK = 1 << 18  # bytes a recv asks for; a shorter answer means the socket was empty


def frame(payload: bytes) -> bytes:
    """One frame: the payload's length, then the payload."""
    return LENGTH.pack(len(payload)) + payload


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """The engine core's end and the frontend's."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


class Frames:
    """Splits a byte stream into its frames; a frame cut between reads waits for its rest."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def split(self, data: bytes) -> list[memoryview]:
        if self._pending:
            data = self._pending + data
        view = memoryview(data)
        size = len(data)
        frames = []
        offset = 0
        while size - offset >= LENGTH.size:
            end = offset + LENGTH.size + LENGTH.unpack_from(data, offset)[0]
            if end > size:
                break
            frames.append(view[offset + LENGTH.size : end])
            offset = end
        self._pending = data[offset:]
        return frames


def read_available(sock: socket.socket, frames: Frames) -> tuple[list[memoryview], bool]:
    """Every whole frame the socket holds now, without blocking, and whether the peer has closed it."""
    chunks = []
    closed = False
    while True:
        try:
            chunk = sock.recv(_CHUNK, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        except ConnectionResetError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        chunks.append(chunk)
        if len(chunk) < _CHUNK:
            break
    if not chunks:
        return [], closed
    return frames.split(chunks[0] if len(chunks) == 1 else b"".join(chunks)), closed


class Outbox:
    """Writes to a non-blocking socket from an asyncio loop without ever blocking it: what the socket
    cannot take now waits here and goes when the socket is writable. `on_error` runs when a send fails
    (the peer has gone); `close` stops the watching and drops what waits."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, on_error: Callable[[], None]
    ) -> None:
        self._sock = sock
        self._loop = loop
        self._on_error = on_error
        self._waiting = bytearray()
        self.stalled_since = 0.0  # when the bytes waiting last stopped draining (time.monotonic())

    def __len__(self) -> int:
        """The bytes waiting for the socket."""
        return len(self._waiting)

    def write(self, data: bytes) -> None:
        if self._waiting:
            self._waiting += data
            return
        sent = self._send(data)
        if sent is not None and sent < len(data):
            self._waiting += data[sent:]
            self.stalled_since = time.monotonic()
            self._loop.add_writer(self._sock.fileno(), self._writable)

    def drain(self, timeout_s: float) -> None:
        """Sends what waits, blocking for `timeout_s` at most (for a last goodbye; errors ignored)."""
        if self._waiting:
            try:
                self._sock.settimeout(timeout_s)
                self._sock.sendall(self._waiting)
            except OSError:
                pass

    def close(self) -> None:
        if self._waiting:
            self._loop.remove_writer(self._sock.fileno())
            self._waiting.clear()

    def _send(self, data: bytes | bytearray) -> int | None:
        """Bytes the socket took now; None when it failed."""
        try:
            return self._sock.send(data)
        except BlockingIOError:
            return 0
        except OSError:
            self._on_error()
            return None

    def _writable(self) -> None:
        sent = self._send(self._waiting)
        if not sent:
            return
        del self._waiting[:sent]
        self.stalled_since = time.monotonic()
        if not self._waiting:
            self._loop.remove_writer(self._sock.fileno())


class CoreEnd:
    """A stub engine core's end (`ortfleet.bench.crossing`): blocking sends of steps, commands taken
    without blocking between steps. The engine core itself (server.py) never blocks on a frontend."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._frames = Frames()
        self.closed = False  # the frontend has gone

    def fileno(self) -> int:
        return self._sock.fileno()

    def send_step(self, payload: bytes) -> None:
        self._sock.sendall(frame(payload))

    def commands(self) -> list[Command]:
        frames, closed = read_available(self._sock, self._frames)
        self.closed = self.closed or closed
        return [decode_command(frame) for frame in frames]

    def wait_commands(self, timeout: float) -> list[Command]:
        """The commands that arrive within `timeout` seconds (for an engine core with nothing to run)."""
        readable, _, _ = select.select([self._sock], [], [], timeout)
        return self.commands() if readable else []

    def close(self) -> None:
        self._sock.close()


class FrontendEnd:
    """The frontend's end on its asyncio loop: each wake-up hands `on_steps` every step that has arrived,
    in order; `on_closed` runs once when the engine core's end is gone."""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        on_steps: Callable[[list[Step]], None],
        on_closed: Callable[[], None],
    ) -> None:
        self._sock = sock
        self._loop = loop
        self._on_steps = on_steps
        self._on_closed = on_closed
        self._frames = Frames()
        self._outbox = Outbox(sock, loop, self._lost)
        self.closed = False
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._readable)

    def send(self, command: Command) -> None:
        """Sends a command without blocking; what the socket cannot take yet goes when it can."""
        self.send_all([command])

    def send_all(self, commands: list[Command]) -> None:
        """Sends commands in one write, so that the engine core reads them together."""
        if not self.closed and commands:
            self._outbox.write(b"".join(frame(encode_command(command)) for command in commands))

    def _readable(self) -> None:
        frames, closed = read_available(self._sock, self._frames)
        if frames:
            self._on_steps([decode_step(frame) for frame in frames])
        if closed:
            self._lost()

    def _lost(self) -> None:
        if not self.closed:
            self.close()
            self._on_closed()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._sock.fileno())
        self._outbox.close()
        self._sock.close()
