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

import contextlib
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO

from ortfleet.forked_main import Channel, ServerLink, run_child, serve_forks

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


class BuilderServerFailed(RuntimeError):
    """The server could not start, or ended while serving."""


# The server side: `python -c "from ortfleet.modelbuild.build_server import main; main()" --fd N
# [--preload MODULE ...]`.


def main(argv: Sequence[str] | None = None) -> None:
    serve_forks(
        argv,
        prog="build_server",
        description="Serve builds, each forked from this process after its imports (see the module's "
        "documentation for the protocol); started by ortfleet.modelbuild.convert.builder_server.",
        serve=_serve,
    )


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
        self._lock = threading.Lock()  # held from a build's start to its end
        self._launch_lock = threading.Lock()
        self._link = ServerLink(
            _SERVER_CODE,
            env={**self._env, **SERVER_ENVIRONMENT},
            preload=preload,
            name="builder server",
            failure=BuilderServerFailed,
        )
        self.builds = 0

    @property
    def pid(self) -> int | None:
        """The server's, once it is ready."""
        return self._link.pid

    def launch(self) -> None:
        """Start the server's process, if not yet, without waiting for its imports: they then run
        while the requester prepares its first build."""
        with self._launch_lock:
            self._link.launch()

    def start(self, argv: Sequence[str]) -> ForkedBuild:
        """Fork a child of the server that runs ``python -m`` with ``argv`` (the module and its
        arguments) in this process's working folder, with the server's environment."""
        self._lock.acquire()
        try:
            self.launch()
            read, write = os.pipe()
            try:
                request = {"argv": list(argv), "cwd": os.getcwd(), "env": self._env}
                self._link.send(request, [write])
            except BaseException:
                os.close(read)
                raise
            finally:
                os.close(write)
            stdout = open(read, errors="replace")  # the build's to close
            try:
                pid = int(self._link.reply("pid"))
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
            return int(self._link.reply("returncode"))
        finally:
            self._lock.release()

    def close(self) -> None:
        """End the server (it exits when its socket closes) and wait for it; a later build starts a new
        one."""
        with self._lock, self._launch_lock:
            self._link.close()
