"""What a server that forks ``python -m MODULE`` runs needs: a child that runs a module as a fresh
interpreter would, after its server has paid the imports once, and the server's JSON-line channel to its
requester. The model builder's server (modelbuild/build_server.py) and the fleet's process server
(fleet/process_server.py) are two such servers.

A child of such a server differs from a fresh interpreter in what the server imported before it forked:
those modules were imported with the server's environment, not the child's. A server imports only
modules that read no setting on import, and refuses to serve if its imports started a thread, so that
forking it is safe.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import io
import json
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any, NoReturn

_MESSAGE_MAX_BYTES = 1 << 20
_LOG_TAIL_CHARS = 4000


class Channel:
    """JSON lines on a stream socket, with file descriptors passed beside a message."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""

    def send(self, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
        data = json.dumps(message).encode() + b"\n"
        sent = socket.send_fds(self.sock, [data], list(fds)) if fds else self.sock.send(data)
        if sent < len(data):
            self.sock.sendall(data[sent:])

    def receive(self) -> tuple[dict[str, Any] | None, list[int]]:
        """The next message and the descriptors that came with it; None at the end of the stream."""
        fds: list[int] = []
        while b"\n" not in self._buffer:
            if len(self._buffer) > _MESSAGE_MAX_BYTES:
                raise ValueError("a message longer than 1 MiB")
            data, received, _flags, _address = socket.recv_fds(self.sock, 65536, 4)
            fds += received
            if not data:
                for fd in fds:
                    os.close(fd)
                return None, []
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        message: dict[str, Any] = json.loads(line)
        return message, fds


def import_for_children(module: str) -> None:
    """Import ``module`` for what it imports, then forget it: a child runs a module as ``__main__`` in a
    fresh copy (as ``python -m`` does), and runpy warns of one already imported under its own name."""
    importlib.import_module(module)
    sys.modules.pop(module, None)
    parent, _, child = module.rpartition(".")
    if parent in sys.modules:
        vars(sys.modules[parent]).pop(child, None)


def preload(modules: Iterable[str]) -> None:
    """Import each of ``modules`` for the children (import_for_children), then check that no thread
    runs: forking a process with threads is not safe."""
    for module in modules:
        import_for_children(module)
    threads = thread_count()
    if threads > 1:
        raise RuntimeError(f"{threads} threads run after the imports: forking this process is not safe")


def thread_count() -> int:
    """The threads of this process, those of native libraries included where the system shows them."""
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/self/task"))
    return threading.active_count()


def run_child(
    request: Mapping[str, Any], output: int, *, close: Iterable[int] = (), new_group: bool = False
) -> NoReturn:
    """In a forked child: run ``request["argv"]`` (a module and its arguments) as ``python -m`` would,
    in ``request["cwd"]`` with ``request["env"]``, stdin /dev/null and stdout and stderr ``output``,
    then exit with its status. ``close``: the server's descriptors, closed first; ``new_group``: the
    child leads a process group of its own."""
    code = 1
    try:
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd)
        if new_group:
            os.setpgid(0, 0)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(stdin)
        os.close(output)
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(line_buffering=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        module, *args = request["argv"]
        sys.argv = [module, *args]
        if sys.path and sys.path[0] == "":
            sys.path[0] = os.getcwd()  # as `python -m` has it (the server's `python -c` has "")
        code = _run_as_main(module)
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run_as_main(module: str) -> int:
    """Run ``module`` as ``python -m`` would, and the exit status that interpreter would end with."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does on its way out: wait for the threads that are not daemons, then the
    # atexit functions.
    shutdown = getattr(threading, "_shutdown", None)
    if callable(shutdown):
        shutdown()
    atexit._run_exitfuncs()
    return code


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# A fork server's two ends: its process's main, and the requester's link to that process.


def serve_forks(
    argv: Sequence[str] | None, *, prog: str, description: str, serve: Callable[[Channel], None]
) -> None:
    """A fork server's main: ``--fd N`` (its end of the requester's socket pair) and ``--preload
    MODULE`` (each imported for the children first); it says ``{"ready": PID}`` (or ``{"error": TEXT}``
    and exits) and then `serve`s the channel until the requester's end closes."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--fd", type=int, required=True, help="the descriptor of its socket's end")
    parser.add_argument(
        "--preload", action="append", default=[], help="a module to import first for what it imports"
    )
    args = parser.parse_args(argv)
    channel = Channel(socket.socket(fileno=args.fd))
    try:
        preload(args.preload)
    except BaseException as e:
        traceback.print_exc()
        channel.send({"error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from e
    sys.stdout.flush()
    sys.stderr.flush()
    channel.send({"ready": os.getpid()})
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        serve(channel)


class ServerLink:
    """The requester's end of a fork server: its process, started by :meth:`launch` (its imports then
    run while the requester goes on), and the replies read from it. Once the server has ended, every
    call raises ``failure`` with the end of the server's output. Not thread-safe: its owner locks."""

    def __init__(
        self,
        code: str,
        *,
        env: Mapping[str, str],
        preload: Sequence[str],
        name: str,
        failure: type[RuntimeError],
    ) -> None:
        self._code = code
        self._env = dict(env)
        self._preload = tuple(preload)
        self._name = name
        self._failure_type = failure
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._log: IO[bytes] | None = None
        self._failure: RuntimeError | None = None
        self.pid: int | None = None  # the server's, once it is ready

    def launch(self) -> None:
        if self._process is not None:
            return
        ours, theirs = socket.socketpair()
        self._log = tempfile.TemporaryFile()
        preload = [arg for module in self._preload for arg in ("--preload", module)]
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", self._code, "--fd", str(theirs.fileno()), *preload],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self._env,
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._channel = Channel(ours)

    def ready(self) -> Channel:
        """The channel, once the server has said it is ready (launched first if need be)."""
        self.launch()
        assert self._channel is not None
        if self.pid is None:
            self.pid = int(self.reply("ready"))
        return self._channel

    def send(self, request: Mapping[str, Any], fds: Sequence[int]) -> None:
        channel = self.ready()
        if self._failure is not None:
            raise self._failure
        try:
            channel.send(request, fds=fds)
        except OSError as e:
            raise self._failed(None) from e

    def reply(self, key: str) -> Any:
        """The value of `key` in the server's next message."""
        assert self._channel is not None
        if self._failure is not None:
            raise self._failure
        try:
            message, _ = self._channel.receive()
        except OSError as e:
            raise self._failed(None) from e
        if message is None or key not in message:
            raise self._failed(message.get("error") if message else None)
        return message[key]

    def _failed(self, said: str | None) -> RuntimeError:
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
        output = ""
        if self._log is not None:
            self._log.seek(0)
            output = self._log.read().decode(errors="replace")[-_LOG_TAIL_CHARS:]
        self._failure = self._failure_type(
            f"the {self._name} ended{f' ({said})' if said else ''}; the end of its output:\n{output}"
        )
        return self._failure

    def close(self) -> None:
        """End the server (it exits when its socket closes) and wait for it; a later call starts anew."""
        if self._channel is not None:
            self._channel.sock.close()
        if self._process is not None:
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._log is not None:
            self._log.close()
        self._channel = self._process = self._log = self._failure = self.pid = None
