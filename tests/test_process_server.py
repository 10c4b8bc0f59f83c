"""The process server (ortfleet/fleet/process_server.py): children forked from one process run a module as
`python -m` would, many at once, and their owner sees them as it sees a subprocess.Popen."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from ortfleet.fleet.launcher import LocalFleet
from ortfleet.fleet.process_server import UNKNOWN_STATUS, ForkedProcess, ProcessServer, ProcessServerFailed
from ortfleet.fleet.processes import stop

# A module the children run: it prints what it was given and then does what its first argument says.
CHILD = """
import os, signal, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE"), "main", __name__, flush=True)
print("group", os.getpgid(0) == os.getpid(), "stdin", sys.stdin.read() == "", flush=True)
what = sys.argv[1]
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "raise":
    raise ValueError("the child raised")
if what == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ProcessServer]:
    (tmp_path / "forked_probe.py").write_text(CHILD)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    made = ProcessServer(env=env, preload=("json",))
    with contextlib.closing(made):
        yield made


def start(server: ProcessServer, tmp_path: Path, *args: str, probe: str = "x") -> tuple[ForkedProcess, Path]:
    log = tmp_path / f"child-{server.started}.log"
    env = {**os.environ, "PROBE": probe, "PYTHONPATH": str(tmp_path)}
    with log.open("wb") as handle:
        child = server.start(["forked_probe", *args], env=env, output=handle.fileno(), cwd=str(tmp_path))
    return child, log


def wait_for_line(log: Path, text: str) -> None:
    deadline = time.monotonic() + 20
    while text not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)


@pytest.mark.unit
def test_a_child_runs_its_module_as_main_with_its_own_arguments_folder_and_environment(
    server: ProcessServer, tmp_path: Path
) -> None:
    child, log = start(server, tmp_path, "exit", "0", probe="first")
    assert child.wait(20) == 0
    lines = log.read_text().splitlines()
    assert lines[0] == f"argv ['exit', '0'] cwd {tmp_path} env first main __main__"
    assert lines[1] == "group True stdin True"
    assert child.pid not in (os.getpid(), server.pid)


@pytest.mark.unit
def test_exit_codes_a_raise_and_a_signal_come_back_as_popen_gives_them(
    server: ProcessServer, tmp_path: Path
) -> None:
    exits, _ = start(server, tmp_path, "exit", "3")
    raises, raised_log = start(server, tmp_path, "raise")
    sleeps, sleeping_log = start(server, tmp_path, "sleep")
    assert exits.wait(20) == 3
    assert raises.wait(20) == 1
    assert "ValueError: the child raised" in raised_log.read_text()
    wait_for_line(sleeping_log, "sleeping")
    assert sleeps.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeps.wait(0.05)
    sleeps.send_signal(signal.SIGTERM)
    assert sleeps.wait(20) == -signal.SIGTERM
    sleeps.kill()  # ended: a no-op, as on a Popen
    assert (sleeps.poll(), sleeps.returncode) == (-signal.SIGTERM, -signal.SIGTERM)


@pytest.mark.unit
def test_many_children_run_at_once_each_with_its_status(server: ProcessServer, tmp_path: Path) -> None:
    sleeping = [start(server, tmp_path, "sleep") for _ in range(6)]
    exiting = [start(server, tmp_path, "exit", str(code))[0] for code in range(6)]
    for _, log in sleeping:
        wait_for_line(log, "sleeping")
    assert [child.wait(20) for child in exiting] == list(range(6))
    assert all(child.poll() is None for child, _ in sleeping)
    for child, _ in sleeping:
        stop(child, timeout_s=20)  # as a fleet stops a process
    assert [child.returncode for child, _ in sleeping] == [-signal.SIGTERM] * 6
    assert server.started == 12


@pytest.mark.unit
def test_threads_waiting_on_one_child_each_get_its_status(server: ProcessServer, tmp_path: Path) -> None:
    child, log = start(server, tmp_path, "sleep")
    wait_for_line(log, "sleeping")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        waits = [pool.submit(child.wait, 20) for _ in range(4)]
        child.terminate()
        assert [w.result() for w in waits] == [-signal.SIGTERM] * 4
    assert child.poll() == child.wait() == -signal.SIGTERM


@pytest.mark.unit
def test_children_outlive_a_closed_server_and_their_end_is_still_seen(
    server: ProcessServer, tmp_path: Path
) -> None:
    child, log = start(server, tmp_path, "sleep")
    wait_for_line(log, "sleeping")
    server.close()
    assert psutil.pid_exists(child.pid) and child.poll() is None
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(20) == UNKNOWN_STATUS


@pytest.mark.unit
def test_a_server_whose_imports_fail_says_why(tmp_path: Path) -> None:
    server = ProcessServer(preload=("ortfleet_no_such_module",))
    with contextlib.closing(server), (tmp_path / "log").open("wb") as log:
        for _ in range(2):  # and again, without waiting for a new server
            with pytest.raises(ProcessServerFailed, match="No module named 'ortfleet_no_such_module'"):
                server.start(["json.tool"], env=dict(os.environ), output=log.fileno())


def test_a_fleet_forks_its_python_processes_from_its_server_and_starts_redis_afresh(tmp_path: Path) -> None:
    server = ProcessServer()
    with contextlib.closing(server), LocalFleet(log_dir=tmp_path, process_server=server) as fleet:
        fleet.start_redis(appendonly=False)
        _, url = fleet.start_gateway()
        (redis,) = fleet._role("redis")
        (gateway,) = fleet.gateways
        assert isinstance(gateway.process, ForkedProcess) and isinstance(redis.process, subprocess.Popen)
        assert psutil.Process(gateway.pid).ppid() == server.pid
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        # Shut down in order, then ended by the signal it was sent, as uvicorn ends a fresh gateway.
        assert gateway.terminate(20) == -signal.SIGTERM
        assert "Finished server process" in gateway.log_tail() and not gateway.alive()
