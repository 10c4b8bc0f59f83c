"""A process that imports the model builder's modules once and runs each build in a child forked from
it, in place of a fresh interpreter per build that spends most of its time on imports (torch,
transformers, onnx_ir and the builder: about 20 s on a 2-vCPU VM, against a few seconds for the build of
a tiny model). :func:`ortfleet.modelbuild.convert.builder_server` starts one for the builds of a process.

A child runs ``python -m MODULE ARGS`` as a fresh interpreter would (``runpy`` as ``__main__``, its
atexit functions at the end), with stdin /dev/null and stdout and stderr the pipe the requester passed,
in the requester's working folder and environment; its exit status is the build's. The server never runs
an onnxruntime-genai model (0.18 cannot build one in a process that has run one) and refuses to serve if
its imports started a thread, so that forking it is safe. The environment the server was started with
is the one its imports saw (Hugging Face's offline switches are read on import): start it with the
builds' environment.

The protocol, on a stream socket of a socket pair whose other end the requester keeps: the server says
``{"ready": PID}`` once it has imported what it preloads (or ``{"error": TEXT}`` and exits); a request is
one JSON line ``{"argv": [MODULE, *ARGS], "cwd": DIR, "env": {...}}`` with the write end of the build's
output pipe as ancillary data; the server answers ``{"pid": PID}`` when the child is forked and
``{"returncode": CODE}`` when it has ended (minus the signal's number if a signal ended it), then serves
the next request. It exits when the requester's end closes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO, Any

from ortfleet.forked_main import Channel, preload, run_child

BUILDER_MODULE = "onnxruntime_genai.models.builder"
# Imported for what they import: the builder's torch, transformers, onnx_ir, onnxruntime's quantizer and
# its own packages (a child then imports some 30 small modules, 0.3 s).
DEFAULT_PRELOAD = (BUILDER_MODULE,)
# The server's imports see these as well, so that no thread runs when it forks (the builds see the
# requester's environment): onnxruntime's telemetry thread, and numpy's OpenBLAS pool, which would start
# at import.
SERVER_ENVIRONMENT = {"ORT_DISABLE_TELEMETRY": "1", "OPENBLAS_NUM_THREADS": "1"}
# `python -m` would import the package first, which imports this module: runpy warns of that.
_SERVER_CODE = f"from {__name__} import main; main()"
_LOG_TAIL_CHARS = 4000


class BuilderServerFailed(RuntimeError):
    """The server could not start, or ended while serving."""


# The server side: `python -c "from ortfleet.modelbuild.build_server import main; main()" --fd N
# [--preload MODULE ...]`.


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="build_server",
        description="Serve builds, each forked from this process after its imports (see the module's "
        "documentation for the protocol); started by ortfleet.modelbuild.convert.builder_server.",
    )
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
        _serve(channel)


def _serve(channel: Channel) -> None:
    while True:
        request, fds = channel.receive()
        if request is None:
            return
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            channel.send({"pid": 0})
            channel.send({"returncode": 1})  # no output pipe to say why on
            continue
        (output,) = fds
        pid = os.fork()
        if pid == 0:
            run_child(request, output, close=[channel.sock.fileno()])
        os.close(output)
        channel.send({"pid": pid})
        _, status = os.waitpid(pid, 0)
        channel.send({"returncode": os.waitstatus_to_exitcode(status)})


# The requester's side.


class ForkedBuild:
    """A build running in a child of the server, used as a :class:`subprocess.Popen` is: read
    ``stdout`` to its end, then :meth:`wait` for the exit status (or :meth:`kill` it)."""

    def __init__(self, server: BuilderServer, pid: int, stdout: IO[str]) -> None:
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def kill(self) -> None:
        if self.returncode is None and self.pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._server._finish()
        return self.returncode

    def __enter__(self) -> ForkedBuild:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stdout.close()
        self.wait()


class BuilderServer:
    """The requester's handle on a server, started at its first build (or by :meth:`launch`): its
    imports are paid once however many builds follow, and never when none does. One build runs at a
    time; a build asked for meanwhile waits for it. ``env`` is the environment of the server and of
    every build."""

    def __init__(self, *, env: Mapping[str, str], preload: Sequence[str] = DEFAULT_PRELOAD) -> None:
        self._env = dict(env)
        self._preload = tuple(preload)
        self._lock = threading.Lock()  # held from a build's start to its end
        self._launch_lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._log: IO[bytes] | None = None
        self._failure: BuilderServerFailed | None = None
        self.pid: int | None = None  # the server's, once it is ready
        self.builds = 0

    def launch(self) -> None:
        """Start the server's process, if not yet, without waiting for its imports: they then run
        while the requester prepares its first build."""
        with self._launch_lock:
            if self._process is not None:
                return
            ours, theirs = socket.socketpair()
            self._log = tempfile.TemporaryFile()
            preload = [arg for module in self._preload for arg in ("--preload", module)]
            try:
                self._process = subprocess.Popen(
                    [sys.executable, "-c", _SERVER_CODE, "--fd", str(theirs.fileno()), *preload],
                    stdin=subprocess.DEVNULL,
                    stdout=self._log,
                    stderr=subprocess.STDOUT,
                    env={**self._env, **SERVER_ENVIRONMENT},
                    pass_fds=(theirs.fileno(),),
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self._channel = Channel(ours)

    def start(self, argv: Sequence[str]) -> ForkedBuild:
        """Fork a child of the server that runs ``python -m`` with ``argv`` (the module and its
        arguments) in this process's working folder, with the server's environment."""
        self._lock.acquire()
        try:
            channel = self._ready()
            read, write = os.pipe()
            try:
                request = {"argv": list(argv), "cwd": os.getcwd(), "env": self._env}
                self._send(channel, request, write)
            except BaseException:
                os.close(read)
                raise
            finally:
                os.close(write)
            stdout = open(read, errors="replace")  # the build's to close
            try:
                pid = int(self._reply("pid"))
            except BaseException:
                stdout.close()
                raise
            self.builds += 1
            return ForkedBuild(self, pid, stdout)
        except BaseException:
            self._lock.release()
            raise

    def _finish(self) -> int:
        try:
            return int(self._reply("returncode"))
        finally:
            self._lock.release()

    def _ready(self) -> Channel:
        self.launch()
        assert self._channel is not None
        if self.pid is None:
            self.pid = int(self._reply("ready"))
        return self._channel

    def _send(self, channel: Channel, request: Mapping[str, Any], output: int) -> None:
        if self._failure is not None:
            raise self._failure
        try:
            channel.send(request, fds=[output])
        except OSError as e:
            raise self._failed(None) from e

    def _reply(self, key: str) -> Any:
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

    def _failed(self, said: str | None) -> BuilderServerFailed:
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
        output = ""
        if self._log is not None:
            self._log.seek(0)
            output = self._log.read().decode(errors="replace")[-_LOG_TAIL_CHARS:]
        self._failure = BuilderServerFailed(
            f"the builder server ended{f' ({said})' if said else ''}; the end of its output:\n{output}"
        )
        return self._failure

    def close(self) -> None:
        """End the server (it exits when its socket closes) and wait for it; a later build starts a new
        one."""
        with self._lock, self._launch_lock:
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
