"""A process that imports what gateways, workers and engine cores import, once, and forks each of a
fleet's Python processes from it: on a 2-vCPU VM a gateway then starts on about 0.15 s of CPU rather
than 1.2 s, most of it imports (redis, pydantic, Starlette, uvicorn and ortfleet's own modules), and a
worker on about 0.5 s (its model runtime's imports and its model's load) rather than 1.2 s. The test
suite, which starts some 650 such processes, saves minutes. The processes are the same as ``python -m
gateway`` / ``worker`` / ``worker.core`` started afresh, but for what ortfleet/forked_main.py says of a
forked child.

:class:`LocalFleet` uses one when given (``process_server``); `ortfleet up`, the benchmarks and the
drills start their processes afresh.

The protocol, on a stream socket of a socket pair whose other end the requester keeps: the server says
``{"ready": PID}`` once it has imported what it preloads (or ``{"error": TEXT}`` and exits). A request
is one JSON line ``{"argv": [MODULE, *ARGS], "cwd": DIR, "env": {...}}`` with two descriptors as
ancillary data: the child's output (its stdout and stderr) and the write end of its status socket. The
server forks the child (in a process group of its own), answers ``{"pid": PID}``, and when the child
has ended writes ``{"returncode": CODE}`` (minus the signal's number if a signal ended it) on that
child's status socket and closes it. Many children run at once. The server exits when the requester's
end closes; children still running go on (their fleet stops them).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

from ortfleet.forked_main import Channel, ServerLink, run_child, serve_forks

# Imported for what they import: the gateway's and the worker's modules (the engine core's startup among
# them). Not the model runtime: numpy, whose import starts its BLAS threads, and onnxruntime-genai are
# each child's own.
DEFAULT_PRELOAD = ("gateway.main", "worker.main")
# A child's status when the server ended before it could say.
UNKNOWN_STATUS = 255
_SERVER_CODE = f"from {__name__} import main; main()"


class ProcessServerFailed(RuntimeError):
    """The server could not start, or ended while serving."""


# The server side.


def main(argv: Sequence[str] | None = None) -> None:
    serve_forks(
        argv,
        prog="process_server",
        description="Fork a fleet's Python processes from this one after its imports (see the module's "
        "documentation for the protocol); started by ortfleet.fleet.process_server.ProcessServer.",
        serve=_serve,
    )


def _serve(channel: Channel) -> None:
    # SIGCHLD wakes the loop through a pipe (its handler does nothing; the loop reaps).
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    statuses: dict[int, int] = {}  # a running child's pid: its status socket's descriptor
    requests = channel.sock.fileno()
    while True:
        readable, _, _ = select.select([requests, wake_read], [], [])
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_read, 512):
                    pass
        _reap(statuses)
        if requests not in readable:
            continue
        request, fds = channel.receive()
        if request is None:
            return
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            channel.send({"pid": 0})
            continue
        output, status = fds
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            server_fds = [requests, wake_read, wake_write, status, *statuses.values()]
            run_child(request, output, close=server_fds, new_group=True)
        os.close(output)
        statuses[pid] = status
        channel.send({"pid": pid})


def _reap(statuses: dict[int, int]) -> None:
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = statuses.pop(pid, None)
        if fd is None:
            continue
        with contextlib.suppress(OSError):
            os.write(fd, json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        os.close(fd)


# The requester's side.


class ForkedProcess:
    """A child of the server, used as a :class:`subprocess.Popen` is (``pid``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``) from any thread."""

    def __init__(self, args: Sequence[str], pid: int, status: socket.socket) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._status = status
        self._lock = threading.Lock()
        self._orphaned = False  # the server ended before the child: its status is unknown

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> bool:
        """Whether the child has ended, waiting up to `timeout` (None: until it has) for its status."""
        if self.returncode is not None:
            return True
        if not self._orphaned:
            # The server closes the status socket once it has written (or ended): then it stays readable.
            # Whoever reads the status closes our end; a thread that was waiting on it then finds the
            # status set.
            try:
                readable, _, _ = select.select([self._status], [], [], timeout)
            except (OSError, ValueError):
                readable = [self._status]
            if not readable:
                return False
            with self._lock:
                if self.returncode is None and not self._orphaned:
                    self._receive_status()
                    self._status.close()
            if self.returncode is not None:
                return True
        # The server ended first: the child is done once it is gone (whoever adopted it reaps it).
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = UNKNOWN_STATUS
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _receive_status(self) -> None:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self._status.recv(256)
            if not chunk:
                break
            data += chunk
        if data.strip():
            self.returncode = int(json.loads(data)["returncode"])
        else:
            self._orphaned = True


class ProcessServer:
    """The requester's handle on a server, started at its first process: its imports are paid once
    however many processes follow. The server runs with `env` (what its imports see; this process's
    environment by default); each process gets the environment its request gives."""

    def __init__(self, *, env: Mapping[str, str] | None = None, preload: Sequence[str] = DEFAULT_PRELOAD):
        self._lock = threading.Lock()  # one request and its answer at a time
        self._link = ServerLink(
            _SERVER_CODE,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
            preload=preload,
            name="process server",
            failure=ProcessServerFailed,
        )
        self.started = 0

    @property
    def pid(self) -> int | None:
        """The server's, once it is ready."""
        return self._link.pid

    def start(
        self, argv: Sequence[str], *, env: Mapping[str, str], output: int, cwd: str | None = None
    ) -> ForkedProcess:
        """Fork a child that runs ``python -m`` with ``argv`` (the module and its arguments) with `env`,
        its stdout and stderr the descriptor `output` (the caller's to close), in `cwd` (this process's
        working folder by default)."""
        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                request = {"argv": list(argv), "cwd": cwd or os.getcwd(), "env": dict(env)}
                self._link.send(request, [output, theirs.fileno()])
                pid = int(self._link.reply("pid"))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        if pid <= 0:
            ours.close()
            raise ProcessServerFailed("the process server refused a request without its two descriptors")
        self.started += 1
        return ForkedProcess(argv, pid, ours)

    def close(self) -> None:
        """End the server (it exits when its socket closes) and wait for it; its children go on."""
        with self._lock:
            self._link.close()
