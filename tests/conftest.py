"""Fixtures that start real parts: a redis-server, worker processes on a tiny model, gateways."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from common.processes import (
    free_port,
    spawn,
    start_gateway_process,
    start_redis,
    stop,
    wait_ready,
    worker_command,
)
from common.redis_client import connect

LOGS = Path(os.environ.get("ORTFLEET_TEST_LOGS", tempfile.mkdtemp(prefix="ortfleet-test-logs-")))


@dataclass
class RedisServer:
    port: int
    data_dir: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        stop(self.process)
        self.process = start_redis(self.port, self.data_dir, log=LOGS / f"redis-{self.port}.log")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    port = free_port()
    data = tmp_path_factory.mktemp("redis")
    server = RedisServer(port, data, start_redis(port, data, log=LOGS / f"redis-{port}.log"))
    yield server
    stop(server.process)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = connect(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from common.modelbuild.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@dataclass
class Proc:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def terminate(self, timeout_s: float = 30.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)


@dataclass
class Fleet:
    """Starts gateways and workers against one Redis; stops whatever it started."""

    redis_url: str
    model_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    gateway_url: str = ""

    def _log(self, name: str) -> Path:
        return LOGS / f"{name}-{len(self.procs)}-{os.getpid()}.log"

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        return {**self.env, **(env or {})}

    def start_gateway(self, env: dict[str, str] | None = None) -> tuple[Proc, str]:
        log = self._log("gateway")
        process, url = start_gateway_process(self.redis_url, log, self._env(env))
        proc = Proc("gateway", process, log)
        self.procs.append(proc)
        self.gateway_url = self.gateway_url or url
        return proc, url

    def start_worker(
        self, name: str, *extra: str, wait: bool = True, env: dict[str, str] | None = None
    ) -> Proc:
        """A worker serving the tiny model as `name`; waits until the gateway sees it live."""
        before = self.live_workers(name)
        log = self._log(f"worker-{name}")
        command = worker_command(self.model_dir, name=name, extra=extra)
        proc = Proc(f"worker-{name}", spawn(command, log, self.redis_url, self._env(env)), log)
        self.procs.append(proc)
        if wait:
            try:
                wait_ready(self.gateway_url, workers=before + 1, model=name, timeout_s=60)
            except Exception:
                print(proc.log_tail(), file=sys.stderr)
                raise
        return proc

    def live_workers(self, model: str) -> int:
        reply = httpx.get(f"{self.gateway_url}/readyz", timeout=5)
        workers: int = reply.json().get("models", {}).get(model, {}).get("workers", 0)
        return workers

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            stop(proc.process, timeout_s=10)


@pytest.fixture
def fleet(redis_server: RedisServer, tiny_model: Path) -> Iterator[Fleet]:
    """A gateway of its own; each test starts the workers it needs under model names of its own."""
    fleet = Fleet(redis_server.url, tiny_model)
    fleet.start_gateway()
    yield fleet
    fleet.stop_all()


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as http:
        yield http


@pytest.fixture
def model_name(request: pytest.FixtureRequest) -> str:
    """A served model name unique to the test, so tests never share a queue."""
    return "tiny-" + request.node.name.removeprefix("test_").replace("_", "-")[:40]
