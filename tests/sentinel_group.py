"""A Redis primary with a replica and three Sentinels, started on free ports for a test (the `sentinels`
fixture in tests/conftest.py), and an SSE reader of one job's events."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import aconnect_sse
from redis import Redis as SyncRedis

from ortfleet.fleet.processes import free_port, redis_server_binary, stop, wait_for_port
from tests.conftest import LOGS
from tests.jobs_client import Event

SERVICE = "ortfleet-main"


@dataclass
class SentinelGroup:
    directory: Path
    primary_port: int = 0
    replica_port: int = 0
    sentinel_ports: list[int] = field(default_factory=list)
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start_redis(self, *extra: str) -> int:
        port = free_port()
        data = self.directory / f"redis-{port}"
        data.mkdir()
        command = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
        command += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        command += ["--repl-diskless-sync-delay", "0"]  # a replica's first sync at once, not after 5 s
        command += ["--logfile", str(LOGS / f"redis-{port}.log"), *extra]
        self._spawn(port, command, "redis-server")
        return port

    def start_sentinel(self) -> int:
        port = free_port()
        config = self.directory / f"sentinel-{port}.conf"
        config.write_text(
            f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.directory}\n"
            f"logfile {LOGS / f'sentinel-{port}.log'}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        sentinel = shutil.which("redis-sentinel") or "/usr/bin/redis-sentinel"
        self._spawn(port, [sentinel, str(config)], "redis-sentinel")
        self.sentinel_ports.append(port)
        return port

    def _spawn(self, port: int, command: list[str], what: str) -> None:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.processes[port] = process
        wait_for_port(port, process, what)

    def primary(self, sentinel_port: int) -> int | None:
        with SyncRedis(port=sentinel_port, socket_timeout=2, decode_responses=True) as sentinel:
            address = sentinel.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
        return int(address[1]) if address else None

    def wait_until(self, ready: Any, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
            time.sleep(0.1)

    def replica_synced(self, port: int | None = None) -> bool:
        """The replica (the group's, or the one on `port`) holds its primary's data and follows its writes
        (it can confirm a submission)."""
        with SyncRedis(port=port or self.replica_port, socket_timeout=2, decode_responses=True) as replica:
            return bool(replica.info("replication").get("master_link_status") == "up")

    def watching(self) -> bool:
        """Every sentinel sees the replica and the two other sentinels."""
        for port in self.sentinel_ports:
            with SyncRedis(port=port, socket_timeout=2, decode_responses=True) as sentinel:
                master = sentinel.sentinel_master(SERVICE)
                replicas = sentinel.sentinel_slaves(SERVICE)
            if master["num-other-sentinels"] < 2 or not any(
                r["port"] == self.replica_port and not r["is_sdown"] for r in replicas
            ):
                return False
        return True

    def stop_all(self) -> None:
        for process in self.processes.values():
            stop(process)


@dataclass
class Reader:
    """One SSE client of a job: the events it got, as they come."""

    job_id: str
    events: list[Event] = field(default_factory=list)

    def tokens(self) -> int:
        return sum(1 for event in self.events if event.event == "token")

    async def read(self, client: httpx.AsyncClient) -> None:
        async with aconnect_sse(client, "GET", f"/v1/jobs/{self.job_id}/events") as source:
            async for sse in source.aiter_sse():
                self.events.append(Event(sse.id, sse.event, json.loads(sse.data)))
                if sse.event in ("done", "error"):
                    return
