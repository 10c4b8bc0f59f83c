"""A throwaway local fleet for a benchmark: redis-server, a gateway and workers on free ports."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from common.processes import (
    free_port,
    spawn,
    start_gateway_process,
    start_redis,
    stop,
    wait_ready,
    worker_command,
)


class LocalFleet:
    """Starts what a benchmark needs and stops all of it on close (or on leaving a `with`)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ortfleet-bench-"))
        self.env = {"ORTFLEET_LOG_LEVEL": "warning", **(env or {})}
        self.redis_port = free_port()
        self.redis = start_redis(self.redis_port, self.dir / "redis", appendonly=False)
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.gateways: list[subprocess.Popen[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.url = ""

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_gateway(self) -> str:
        log = self.dir / f"gateway-{len(self.gateways)}.log"
        process, url = start_gateway_process(self.redis_url, log, self.env)
        self.gateways.append(process)
        self.url = self.url or url
        return url

    def start_worker(
        self, model: Path | None, name: str, extra: Sequence[str] = ()
    ) -> subprocess.Popen[bytes]:
        """A worker serving `model` (None with `--fake-engine` in extra) as `name`."""
        command = worker_command(model or Path("."), name=name, extra=extra)
        process = spawn(command, self.dir / f"worker-{len(self.workers)}.log", self.redis_url, self.env)
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
