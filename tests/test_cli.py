"""The `ortfleet` command: `config` shows settings with secrets masked; `up` runs a whole local fleet."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, SimpleQueue

import httpx
import psutil
import pytest

from common.store_epoch import epoch_of
from ortfleet.fleet.launcher import worker_grace_s
from ortfleet.fleet.processes import REDIS_MISSING, free_port
from ortfleet.fleet.redis_cluster import RedisCluster
from tests.conftest import LOGS
from tests.test_lora import write_adapter

SECRET = "hunter2-s3cret"


def ortfleet(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ortfleet", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_config_masks_the_password_in_the_redis_url() -> None:
    result = ortfleet("config", env={"ORTFLEET_REDIS_URL": f"redis://:{SECRET}@db.example:6380/1"})

    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert "redis://:****@db.example:6380/1" in result.stdout
    assert "ORTFLEET_REDIS_URL" in result.stdout


def test_config_json_shows_gateway_and_worker_settings() -> None:
    result = ortfleet("config", "--json", env={"ORTFLEET_REDIS_URL": f"rediss://app:{SECRET}@db.example/0"})

    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["gateway"]["redis_url"] == shown["worker"]["redis_url"] == "rediss://app:****@db.example/0"
    assert shown["gateway"]["port"] == 8000
    assert shown["worker"]["device"] == "auto"
    assert SECRET not in result.stdout


@dataclass
class Up:
    """An `ortfleet up` process: stdout lines as they come, stderr (the fleet's logs) in a file."""

    process: subprocess.Popen[str]
    log: Path
    lines: SimpleQueue[str | None] = field(default_factory=SimpleQueue)
    stdout: list[str] = field(default_factory=list)

    def read_until(self, marker: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not any(marker in line for line in self.stdout):
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except Empty:
                raise AssertionError(
                    f"no {marker!r} from ortfleet up in {timeout_s:g} s\n{self.logs()}"
                ) from None
            if line is None:
                raise AssertionError(f"ortfleet up ended before printing {marker!r}\n{self.logs()}")
            self.stdout.append(line)
        return "".join(self.stdout)

    def descendants(self) -> list[psutil.Process]:
        children: list[psutil.Process] = psutil.Process(self.process.pid).children(recursive=True)
        return children

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@contextmanager
def ortfleet_up(log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Up]:
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "ortfleet", "up", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, **(env or {})},
        )
    up = Up(process, log)

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            up.lines.put(line)
        up.lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    children: list[psutil.Process] = []
    try:
        yield up
    finally:
        if process.poll() is None:
            children = up.descendants()
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for child in children:
            if child.is_running():
                child.kill()


def test_up_runs_a_fleet_that_serves_jobs_and_stops_cleanly_on_ctrl_c(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with ortfleet_up(
        tmp_path / "up.log", "--model", str(tiny_model), "--workers", "2", "--port", str(port)
    ) as up:
        printed = up.read_until("curl -N", timeout_s=120)
        assert f"{base}/openapi.json" in printed
        assert f'curl -N "{base}/v1/jobs/$JOB/events"' in printed

        with httpx.Client(base_url=base, timeout=60) as http:
            ready = http.get("/readyz").json()
            assert ready["models"][tiny_model.name]["workers"] == 2
            body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
            submitted = http.post("/v1/jobs", json=body)
            assert submitted.status_code == 202, submitted.text
            job = submitted.json()
            deadline = time.monotonic() + 60
            while job["status"] not in ("succeeded", "failed", "cancelled") and time.monotonic() < deadline:
                job = http.get(f"/v1/jobs/{job['id']}", params={"wait": 10}).json()
            assert job["status"] == "succeeded", job

        children = up.descendants()
        commands = [" ".join(child.cmdline()) for child in children]
        assert sum("redis-server" in c for c in commands) == 1, commands
        assert sum("-m worker" in c for c in commands) == 2, commands
        assert sum("-m gateway" in c for c in commands) == 1, commands

        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(20) == 0, up.logs()
        _gone, alive = psutil.wait_procs(children, timeout=5)
        assert alive == [], alive

    data_dir = re.search(r"AOF in (\S+)/data\)", up.logs())
    assert data_dir is not None, up.logs()
    assert not Path(data_dir.group(1)).exists()


def test_up_spreads_a_model_over_stores_with_a_worker_each(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with ortfleet_up(
        tmp_path / "up.log",
        "--model",
        str(tiny_model),
        "--workers",
        "2",
        "--stores",
        "2",
        "--port",
        str(port),
    ) as up:
        printed = up.read_until("curl -N", timeout_s=120)
        assert "spread over 2 stores" in up.logs(), up.logs()
        assert base in printed
        commands = [" ".join(child.cmdline()) for child in up.descendants()]
        assert sum("redis-server" in c for c in commands) == 2, commands
        with httpx.Client(base_url=base, timeout=60) as http:
            assert http.get("/readyz").json()["models"][tiny_model.name]["workers"] == 2
            ids = []
            for i in range(6):
                submitted = http.post("/v1/jobs", json={"prompt": f"Hello {i}", "max_tokens": 4})
                assert submitted.status_code == 202, submitted.text
                ids.append(submitted.json()["id"])
            for job_id in ids:
                job = http.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
                assert job["status"] == "succeeded", job
        # A job id carries the epoch of the Redis that holds it: the jobs went to both stores.
        assert len({epoch_of(job_id) for job_id in ids}) == 2, ids


def test_up_on_a_redis_cluster_spreads_the_model_over_hash_tags_of_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    cluster = RedisCluster(tmp_path / "cluster", LOGS)
    cluster.start(primaries=2, replicas_each=0)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        args = ("--model", str(tiny_model), "--workers", "2", "--stores", "2", "--port", str(port))
        with ortfleet_up(tmp_path / "up.log", *args, "--redis-url", cluster.url) as up:
            up.read_until("curl -N", timeout_s=120)
            assert "spread over 2 stores on the Redis Cluster" in up.logs(), up.logs()
            commands = [" ".join(child.cmdline()) for child in up.descendants()]
            assert not any("redis-server" in c for c in commands), commands
            with httpx.Client(base_url=base, timeout=60) as http:
                assert http.get("/readyz").json()["models"][tiny_model.name]["workers"] == 2
                ids = [
                    http.post("/v1/jobs", json={"prompt": f"Hi {i}", "max_tokens": 4}).json()["id"]
                    for i in range(6)
                ]
                for job_id in ids:
                    assert http.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()["status"] == "succeeded"
        # A job id carries its store's epoch: the jobs went to both hash tags.
        assert len({epoch_of(job_id) for job_id in ids}) == 2, ids
    finally:
        cluster.stop_all()


def test_up_passes_each_lora_adapter_to_its_workers(tiny_model: Path, tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "sql", tiny_model, seed=1)
    port = free_port()
    with ortfleet_up(
        tmp_path / "up.log", "--model", str(tiny_model), "--device", "cpu", "--lora", f"sql={adapter}",
        "--port", str(port),
    ) as up:  # fmt: skip
        up.read_until("curl -N", timeout_s=120)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            listed = http.get("/v1/models/sql")
            assert listed.status_code == 200, listed.text
            assert listed.json()["parent"] == tiny_model.name and listed.json()["root"] == str(adapter)
            body = {"model": "sql", "prompt": "Hello", "max_tokens": 4}
            job = http.post("/v1/jobs", json=body).json()
            done = http.get(f"/v1/jobs/{job['id']}", params={"wait": 30}).json()
            assert done["status"] == "succeeded" and done["model"] == "sql", done


def test_up_refuses_more_stores_than_workers(tiny_model: Path) -> None:
    result = ortfleet("up", "--model", str(tiny_model), "--stores", "3", "--workers", "2", "--port", "0")
    assert result.returncode == 1
    assert "--stores 3 with 2 worker(s): each store needs a worker" in result.stderr + result.stdout


def test_up_reports_a_worker_that_dies_and_stops_the_rest(tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "genai_config.json").write_text("{}")

    with ortfleet_up(tmp_path / "up.log", "--model", str(broken), "--port", str(free_port())) as up:
        assert up.process.wait(120) != 0

    logs = up.logs()
    assert re.search(r"worker-1 \(pid \d+\) exited unexpectedly with code 1; stopping the fleet", logs), logs
    assert re.search(r"last \d+ log lines of worker-1:\n  ", logs), logs
    started = {int(pid) for pid in re.findall(r"^(?!\[).*\bpid (\d+)", logs, flags=re.MULTILINE)}
    assert len(started) == 3, logs  # redis, the worker, the gateway
    assert not [pid for pid in started if psutil.pid_exists(pid)], logs


def test_up_without_redis_server_prints_the_install_hint(tiny_model: Path) -> None:
    path = os.pathsep.join(
        folder
        for folder in os.environ.get("PATH", "").split(os.pathsep)
        if folder and not (Path(folder) / "redis-server").exists()
    )

    result = ortfleet("up", "--model", str(tiny_model), "--port", str(free_port()), env={"PATH": path})

    assert result.returncode != 0
    assert REDIS_MISSING in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.unit
def test_a_stopping_fleet_waits_for_each_worker_the_shutdown_grace_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ORTFLEET_SHUTDOWN_GRACE_S", raising=False)
    assert worker_grace_s({}) == 30.0, "the default"
    (tmp_path / ".env").write_text("ORTFLEET_SHUTDOWN_GRACE_S=12\n")
    assert worker_grace_s({}) == 12.0, "the .env file the worker reads"
    monkeypatch.setenv("ORTFLEET_SHUTDOWN_GRACE_S", "7")
    assert worker_grace_s({}) == 7.0, "the environment it inherits"
    assert worker_grace_s({"ORTFLEET_SHUTDOWN_GRACE_S": "0.5"}) == 0.5, "the environment it is given"
