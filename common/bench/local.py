"""A throwaway local fleet for a benchmark: redis-server, a gateway and workers on free ports."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from common.processes import (
    child_env,
    free_port,
    gateway_command,
    start_redis,
    stop,
    wait_for_port,
    wait_ready,
    worker_command,
)


class LocalFleet:
    """Starts what a benchmark needs and stops all of it on close (or on leaving a `with`)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ortfleet-bench-"))
        self.env = {**os.environ, "ORTFLEET_LOG_LEVEL": "warning", **(env or {})}
        self.redis_port = free_port()
        self.redis = start_redis(self.redis_port, self.dir / "redis", appendonly=False)
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.env.update(child_env(self.redis_url))
        self.gateways: list[subprocess.Popen[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.url = ""

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.dir / f"{name}.log").open("wb")
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def start_gateway(self) -> str:
        port = free_port()
        process = self._spawn(f"gateway-{len(self.gateways)}", gateway_command(port))
        self.gateways.append(process)
        wait_for_port(port, process, "the gateway")
        self.url = self.url or f"http://127.0.0.1:{port}"
        return f"http://127.0.0.1:{port}"

    def start_worker(
        self, model: Path | None, name: str, extra: Sequence[str] = ()
    ) -> subprocess.Popen[bytes]:
        """A worker serving `model` (None with `--fake-engine` in extra) as `name`."""
        command = worker_command(model or Path("."), name=name, extra=extra)
        process = self._spawn(f"worker-{len(self.workers)}", command)
        self.workers.append(process)
        return process

    def wait_workers(self, model: str, count: int, timeout_s: float = 300.0) -> None:
        wait_ready(self.url, self.gateways[0], workers=count, model=model, timeout_s=timeout_s)

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        for process in [*self.workers, *self.gateways]:
            stop(process, timeout_s=15)
        stop(self.redis)
