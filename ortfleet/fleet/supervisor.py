"""What `ortfleet up` adds around a local fleet: progress and the children's output on the terminal, and
the signals that stop it."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

from ortfleet.fleet.launcher import FleetProcess, LocalFleet

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class FleetStopped(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class ChildExited(Exception):
    def __init__(self, child: FleetProcess) -> None:
        super().__init__(
            f"{child.name} (pid {child.pid}) exited unexpectedly with code {child.process.returncode}"
        )
        self.child = child


class Console:
    """Progress and the children's prefixed log lines on stderr, one whole line at a time."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.started = time.monotonic()

    def say(self, message: str, end: str = "\n") -> None:
        with self._lock:
            print(message, file=sys.stderr, end=end, flush=True)

    def child_line(self, name: str, line: str) -> None:
        self.say(f"[{name}] {line}")

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.1f} s"


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP stop the fleet: the first raises FleetStopped (held back while a child
    is started and registered, so none escapes the teardown); one during the teardown kills the children."""

    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet
        self.pending: int | None = None
        self._holding = False
        self._previous: dict[int, signal._HANDLER] = {}

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self.pending is not None:
            raise FleetStopped(self.pending)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.fleet.stopping:
            self.fleet.kill_all()
        elif self._holding:
            self.pending = signum
        else:
            raise FleetStopped(signum)
