"""Supervising a local fleet's child processes: their logs on stderr, their exits, an ordered stop."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, SimpleQueue
from types import FrameType

from common.processes import stop

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 20
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class FleetStopped(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class Child:
    name: str
    role: str
    process: subprocess.Popen[bytes]
    log_file: Path | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    watcher: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def last_lines(self) -> list[str]:
        return tail_of(self.log_file) if self.log_file is not None else list(self.tail)


def tail_of(log_file: Path) -> list[str]:
    if not log_file.is_file():
        return []
    return log_file.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]


class ChildExited(Exception):
    def __init__(self, child: Child) -> None:
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


class Supervisor:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.children: list[Child] = []
        self.exits: SimpleQueue[Child] = SimpleQueue()
        self.stopping = False
        self.killed = False

    def spawn(self, name: str, role: str, command: list[str], env: dict[str, str] | None = None) -> Child:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # A group of their own: the terminal's Ctrl-C reaches only `up`, which stops them in order.
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,
        )
        return self._watch(Child(name, role, process), self._forward)

    def adopt(self, name: str, role: str, process: subprocess.Popen[bytes], log_file: Path) -> Child:
        return self._watch(Child(name, role, process, log_file), self._await_exit)

    def _watch(self, child: Child, target: Callable[[Child], None]) -> Child:
        self.children.append(child)
        child.watcher = threading.Thread(
            target=target, args=(child,), name=f"watch-{child.name}", daemon=True
        )
        child.watcher.start()
        return child

    def _forward(self, child: Child) -> None:
        assert child.process.stdout is not None
        for raw in child.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            child.tail.append(line)
            self.console.child_line(child.name, line)
        self._await_exit(child)

    def _await_exit(self, child: Child) -> None:
        child.process.wait()
        self.exits.put(child)

    def check(self) -> None:
        for child in self.children:
            if child.process.poll() is not None:
                raise ChildExited(child)

    def wait_for_exit(self) -> Child:
        while True:
            with contextlib.suppress(Empty):
                return self.exits.get(timeout=1.0)

    def stop_all(self, worker_timeout_s: float) -> None:
        self.stopping = True
        for child in self._role("gateway"):
            self._stop(child, 15.0)
        workers = [c for c in self._role("worker") if c.process.poll() is None]
        if workers:
            self.console.say(f"stopping {len(workers)} worker(s); running jobs are handed back to the queue")
        for child in workers:
            child.process.terminate()
        for child in workers:
            self._stop(child, worker_timeout_s)
        for child in self._role("redis"):
            self._stop(child, 15.0)
        for child in self.children:
            if child.watcher is not None:
                child.watcher.join(timeout=2.0)
        if self.killed:
            self.console.say("stopped again: killed the processes still running (SIGKILL)")

    def kill_all(self) -> None:
        self.killed = True
        for child in self.children:
            if child.process.poll() is None:
                child.process.kill()

    def _role(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    def _stop(self, child: Child, timeout_s: float) -> None:
        if child.process.poll() is not None:
            return
        logger.debug("stopping %s (pid %s)", child.name, child.pid)
        stop(child.process, timeout_s)
        code = child.process.returncode
        if code not in (0, -signal.SIGTERM):
            self.console.say(f"{child.name} (pid {child.pid}) stopped with code {code}")


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP stop the fleet: the first raises FleetStopped (held back while a child
    is started and registered, so none escapes the teardown); one during the teardown kills the children."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
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
        if self.supervisor.stopping:
            self.supervisor.kill_all()
        elif self._holding:
            self.pending = signum
        else:
            raise FleetStopped(signum)
