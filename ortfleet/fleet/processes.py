"""The parts a local fleet is started from: free ports, redis-server, the gateway's and a worker's command
lines, readiness checks and an orderly stop of one process. `ortfleet.fleet.launcher` puts them together."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import httpx

REDIS_MISSING = (
    "redis-server was not found on PATH. Install it: `apt-get install -y redis-server` (Debian/Ubuntu), "
    "`brew install redis` (macOS), or point ortfleet at an existing Redis with ORTFLEET_REDIS_URL."
)


class StartupError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise StartupError(REDIS_MISSING)
    return binary


class ChildProcess(Protocol):
    """A child process of a fleet as its owner uses it: a :class:`subprocess.Popen`, or one forked by a
    process server (ortfleet/fleet/process_server.py)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def start_redis(
    port: int,
    data_dir: Path,
    *,
    appendonly: bool = True,
    log: Path | None = None,
    unix_socket: Path | None = None,
    options: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """A redis-server on 127.0.0.1:port (and on `unix_socket`, if given) keeping its data (AOF, fsync
    every second) in data_dir; `options` are more of its command-line options (`--requirepass`, …)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if log is not None:  # redis-server exits at once when its log file's folder is missing
        log.parent.mkdir(parents=True, exist_ok=True)
    command = [
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data_dir),
        "--save",
        "",
        "--appendonly",
        "yes" if appendonly else "no",
        "--appendfsync",
        "everysec",
        "--protected-mode",
        "no",
        "--logfile",
        str(log) if log else "",
    ]
    if unix_socket is not None:
        command += ["--unixsocket", str(unix_socket), "--unixsocketperm", "700"]
    command += options
    # A process group of its own: a terminal's Ctrl-C does not stop it before the workers hand back
    # their jobs.
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        process_group=0,
    )
    wait_for_port(port, process, "redis-server")
    return process


def wait_for_port(port: int, process: ChildProcess, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StartupError(
                f"{what} exited with code {process.returncode} before listening on port {port}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise StartupError(f"{what} did not listen on port {port} within {timeout_s:g} s")


def child_env(redis_url: str) -> dict[str, str]:
    """The Redis URL for a child process: in its environment, where `ps` does not show a password."""
    return {"ORTFLEET_REDIS_URL": redis_url}


def worker_command(
    model: Path, *, name: str | None = None, device: str = "auto", extra: Sequence[str] = ()
) -> list[str]:
    """A worker's argv; give it the Redis URL with `child_env`."""
    command = [sys.executable, "-m", "worker", "--model", str(model), "--device", device]
    if name:
        command += ["--name", name]
    return [*command, *extra]


def gateway_command(port: int, *, host: str = "127.0.0.1") -> list[str]:
    """A gateway's argv; give it the Redis URL with `child_env`."""
    return [sys.executable, "-m", "gateway", "--host", host, "--port", str(port)]


def wait_ready(
    base_url: str,
    process: ChildProcess | None = None,
    *,
    workers: int = 1,
    model: str | None = None,
    timeout_s: float = 120.0,
) -> None:
    """Until the gateway answers /readyz with at least `workers` live workers (for `model`, if given)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise StartupError(f"the gateway exited with code {process.returncode}")
            try:
                reply = client.get(f"{base_url}/readyz")
                body = reply.json()
                models = body.get("models", {})
                live = (
                    models.get(model, {}).get("workers", 0)
                    if model
                    else sum(m.get("workers", 0) for m in models.values())
                )
                if reply.status_code == 200 and live >= workers:
                    return
                last = body.get("reason") or f"{live} of {workers} workers live"
            except (httpx.HTTPError, ValueError) as e:
                last = str(e)
            time.sleep(0.05)
    raise StartupError(f"the fleet at {base_url} was not ready within {timeout_s:g} s: {last}")


def stop(process: ChildProcess, timeout_s: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
