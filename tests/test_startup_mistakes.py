"""A mistake in how a process is started (a port taken, a Redis that wants a password, a broken model
folder, an invalid setting) ends it at once with one line on stderr that names the problem, and a nonzero
exit status; a gateway whose Redis is only unreachable starts and reports not ready instead."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from common.model_folder import MARKER_NAME, model_fingerprint
from ortfleet.fleet.processes import free_port, start_redis, stop
from tests.conftest import Fleet, RedisServer

# Only against a process that hangs instead of exiting (or answering): a bound on how soon it ends would
# fail on a loaded machine a process that ends as it should, with the right words.
HANG_GUARD_S = 120.0
PASSWORD = "hunter2-s3cret"

Breakage = Callable[[Path], None]


@dataclass
class Exited:
    returncode: int
    stderr: str

    @property
    def last_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""

    def lines_of(self, prog: str) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith(f"{prog}: ")]


def clean_env(**settings: str) -> dict[str, str]:
    """This process's environment without its ORTFLEET_* settings, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTFLEET_")}
    return {**env, **settings}


def run_to_exit(args: list[str], env: dict[str, str], cwd: Path) -> Exited:
    """Runs `python -m ARGS` until it ends (a hang fails the test after HANG_GUARD_S)."""
    process = subprocess.Popen(
        [sys.executable, "-m", *args],
        env=env,
        cwd=cwd,  # where no .env file adds settings of its own
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = process.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"{' '.join(args)} still ran after {HANG_GUARD_S:g} s; its stderr:\n{stderr}")
    return Exited(process.returncode, stderr)


def assert_one_line(exited: Exited, prog: str, *named: str) -> str:
    """The process failed, its last words are one line of its own naming each of `named`, and no
    traceback came before it."""
    assert exited.returncode != 0, exited.stderr
    assert "Traceback" not in exited.stderr, exited.stderr
    assert exited.lines_of(prog) == [exited.last_line], exited.stderr
    for word in named:
        assert word in exited.last_line, exited.stderr
    return exited.last_line


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[int]:
    """A redis-server that wants PASSWORD (requirepass); its port."""
    port = free_port()
    process = start_redis(port, tmp_path, appendonly=False, options=("--requirepass", PASSWORD))
    yield port
    stop(process)


@pytest.fixture
def unreachable_redis() -> str:
    """A Redis URL (with a password) where nothing listens."""
    return f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"


def first_answer(url: str, process: subprocess.Popen[str]) -> httpx.Response:
    """The process's first answer at `url`, once it listens (it announces that by no event of its own)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"exited with code {process.returncode}"
        try:
            return httpx.get(url, timeout=10)
        except httpx.TransportError:
            time.sleep(0.05)
    pytest.fail(f"no answer from {url}")


def gateway(cwd: Path, *args: str, **settings: str) -> Exited:
    return run_to_exit(["gateway", "--port", str(free_port()), *args], clean_env(**settings), cwd)


def worker(cwd: Path, *args: str, **settings: str) -> Exited:
    return run_to_exit(["worker", "--fake-engine", "1:1", *args], clean_env(**settings), cwd)


STARTS = {"gateway": gateway, "worker": worker}


# The gateway


def test_a_gateway_whose_port_is_taken_exits_at_once_naming_the_port(
    redis_server: RedisServer, taken_port: int, tmp_path: Path
) -> None:
    exited = run_to_exit(
        ["gateway", "--port", str(taken_port)], clean_env(ORTFLEET_REDIS_URL=redis_server.url), tmp_path
    )

    line = assert_one_line(exited, "ortfleet-gateway", f"127.0.0.1:{taken_port}", "in use", "--port")
    assert "ORTFLEET_PORT" in line


def test_a_gateway_whose_redis_is_unreachable_starts_says_so_and_reports_not_ready(
    unreachable_redis: str, tmp_path: Path
) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--port", str(port)],
        env=clean_env(ORTFLEET_REDIS_URL=unreachable_redis),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        reply = first_answer(f"http://127.0.0.1:{port}/readyz", process)
        assert reply.status_code == 503
        assert "Redis is unreachable" in reply.json()["reason"]
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=10)
    masked = unreachable_redis.replace(PASSWORD, "****")
    said = [line for line in stderr.splitlines() if masked in line]
    assert len(said) == 1 and "unreachable" in said[0] and "/readyz" in said[0], stderr
    assert PASSWORD not in stderr
    assert "Traceback" not in stderr


def test_invalid_gateway_settings_are_named_one_line_per_variable(
    unreachable_redis: str, tmp_path: Path
) -> None:
    exited = gateway(
        tmp_path,
        ORTFLEET_REDIS_URL=unreachable_redis,
        ORTFLEET_MAX_QUEUED_JOBS="-1",
        ORTFLEET_HEARTBEAT_TTL_S="abc",
    )

    assert exited.returncode != 0
    assert "Traceback" not in exited.stderr, exited.stderr
    assert sorted(exited.lines_of("ortfleet-gateway")) == [
        "ortfleet-gateway: ORTFLEET_HEARTBEAT_TTL_S: Input should be a valid number, unable to parse string "
        "as a number",
        "ortfleet-gateway: ORTFLEET_MAX_QUEUED_JOBS: Input should be greater than or equal to 1",
    ], exited.stderr


# The worker


def test_a_worker_whose_redis_is_unreachable_exits_naming_it(unreachable_redis: str, tmp_path: Path) -> None:
    exited = worker(tmp_path, ORTFLEET_REDIS_URL=unreachable_redis)

    masked = unreachable_redis.replace(PASSWORD, "****")
    assert_one_line(exited, "ortfleet-worker", masked, "ORTFLEET_REDIS_URL")
    assert PASSWORD not in exited.stderr


def test_a_worker_given_a_store_its_model_lacks_exits_naming_the_stores(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    stores = json.dumps({"fake": [redis_server.url, redis_server.url.replace("/0", "/1")]})
    exited = worker(
        tmp_path,
        "--name",
        "fake",
        "--store",
        "3",
        ORTFLEET_REDIS_URL=redis_server.url,
        ORTFLEET_REDIS_SHARDS=stores,
    )

    assert_one_line(
        exited, "ortfleet-worker", "--store", "is 3", "has 2 store(s)", "ORTFLEET_REDIS_SHARDS[fake]"
    )


def test_a_worker_whose_metrics_port_is_taken_exits_naming_the_port(
    redis_server: RedisServer, taken_port: int, tmp_path: Path
) -> None:
    exited = worker(tmp_path, "--metrics-port", str(taken_port), ORTFLEET_REDIS_URL=redis_server.url)

    assert_one_line(exited, "ortfleet-worker", f"127.0.0.1:{taken_port}", "in use", "--metrics-port")


def test_invalid_worker_settings_are_named_one_line_per_variable_or_flag(
    unreachable_redis: str, tmp_path: Path
) -> None:
    exited = worker(
        tmp_path,
        "--max-batch-size",
        "0",
        ORTFLEET_REDIS_URL=unreachable_redis,
        ORTFLEET_HEARTBEAT_TTL_S="abc",
    )

    assert exited.returncode != 0
    assert "Traceback" not in exited.stderr, exited.stderr
    assert sorted(exited.lines_of("ortfleet-worker")) == [
        "ortfleet-worker: --max-batch-size: Input should be greater than or equal to 1",
        "ortfleet-worker: ORTFLEET_HEARTBEAT_TTL_S: Input should be a valid number, unable to parse string "
        "as a number",
    ], exited.stderr


def corrupt_genai_config(model: Path) -> None:
    (model / "genai_config.json").write_text('{"model": {"type": ')


def remove(name: str, *, marker_too: bool = False) -> Breakage:
    """Removes the file; with `marker_too`, the build marker as well (a folder ortfleet did not build)."""

    def broken(model: Path) -> None:
        (model / name).unlink()
        if marker_too:
            (model / MARKER_NAME).unlink()

    return broken


def overwrite_weights(model: Path) -> None:
    """4 KB of the weights overwritten in place (the size unchanged), with bytes that read as NaN."""
    with (model / "model.onnx.data").open("r+b") as weights:
        weights.seek(4096)
        weights.write(b"\xff" * 4096)


@pytest.mark.parametrize(
    ("breakage", "named"),
    [
        (corrupt_genai_config, "genai_config.json"),
        (overwrite_weights, "model.onnx.data"),
        (remove("model.onnx.data"), "model.onnx.data"),
        (remove("tokenizer.json"), "tokenizer.json"),
        (remove("model.onnx.data", marker_too=True), "model.onnx.data"),
        (remove("tokenizer.json", marker_too=True), "tokenizer.json"),
    ],
    ids=[
        "corrupt genai_config.json",
        "weights overwritten, same size",
        "no model.onnx.data",
        "no tokenizer.json",
        "no model.onnx.data, no build marker",
        "no tokenizer.json, no build marker",
    ],
)
def test_a_worker_with_a_broken_model_folder_exits_naming_the_file(
    breakage: Breakage, named: str, tiny_model: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    breakage(model)

    exited = run_to_exit(
        ["worker", "--model", str(model), "--device", "cpu"],
        clean_env(ORTFLEET_REDIS_URL=redis_server.url),
        tmp_path,
    )

    assert_one_line(exited, "ortfleet-worker", str(model), named)


def test_a_worker_whose_weights_compute_nan_exits_after_its_warm_up_naming_its_folder(
    tiny_model: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / MARKER_NAME).unlink()  # a folder ortfleet did not build: no sha256 to check the weights by
    with (model / "model.onnx.data").open("r+b") as weights:  # every weight NaN: greedy picks token 0
        weights.seek(1024)
        weights.write(b"\xff" * ((model / "model.onnx.data").stat().st_size - 2048))

    exited = run_to_exit(
        ["worker", "--model", str(model), "--device", "cpu"],
        clean_env(ORTFLEET_REDIS_URL=redis_server.url),
        tmp_path,
    )

    assert_one_line(exited, "ortfleet-worker", str(model), "greedy generation", "nan", "weights")


def another_model(tiny_model: Path, folder: Path) -> Path:
    """The tiny model with another context length, in a folder of its own (no build marker)."""
    shutil.copytree(tiny_model, folder)
    (folder / MARKER_NAME).unlink()
    config = folder / "genai_config.json"
    config.write_text(config.read_text().replace('"context_length": 512', '"context_length": 256'))
    return folder


def test_a_worker_of_another_model_under_a_served_name_exits_naming_both_models(
    fleet: Fleet, tiny_model: Path, tmp_path: Path, model_name: str
) -> None:
    fleet.start_worker(model_name)
    same = tmp_path / "same"
    shutil.copytree(tiny_model, same)
    fleet.start_worker(model_name, model=same)  # the same files in another folder: the same model
    other = another_model(tiny_model, tmp_path / "other")

    exited = run_to_exit(
        ["worker", "--model", str(other), "--name", model_name, "--device", "cpu"],
        clean_env(ORTFLEET_REDIS_URL=fleet.redis_url),
        tmp_path,
    )

    ours, theirs = model_fingerprint(other), model_fingerprint(tiny_model)
    assert ours != theirs
    assert_one_line(exited, "ortfleet-worker", repr(model_name), str(other), ours, theirs, "--name")


def test_with_log_level_debug_a_startup_mistake_shows_its_traceback_too(
    redis_server: RedisServer, taken_port: int, tmp_path: Path
) -> None:
    exited = worker(
        tmp_path,
        "--metrics-port",
        str(taken_port),
        ORTFLEET_REDIS_URL=redis_server.url,
        ORTFLEET_LOG_LEVEL="debug",
    )

    assert exited.returncode != 0
    assert "Traceback" in exited.stderr
    assert exited.lines_of("ortfleet-worker") == [exited.last_line]
    assert f"127.0.0.1:{taken_port}" in exited.last_line


# ortfleet up


def test_ortfleet_up_names_each_invalid_setting_before_starting_anything(
    redis_server: RedisServer, tiny_model: Path, tmp_path: Path
) -> None:
    exited = run_to_exit(
        ["ortfleet", "up", "--redis-url", redis_server.url, "--model", str(tiny_model), "--port", "0"],
        clean_env(ORTFLEET_MAX_QUEUED_JOBS="-1", ORTFLEET_HEARTBEAT_TTL_S="abc"),
        tmp_path,
    )

    assert exited.returncode != 0
    assert "Traceback" not in exited.stderr, exited.stderr
    assert "starting" not in exited.stderr, exited.stderr
    assert sorted(exited.lines_of("ortfleet up")) == [
        "ortfleet up: ORTFLEET_HEARTBEAT_TTL_S: Input should be a valid number, unable to parse string "
        "as a number",
        "ortfleet up: ORTFLEET_MAX_QUEUED_JOBS: Input should be greater than or equal to 1",
    ], exited.stderr


# Both processes


@pytest.mark.parametrize("process", ["gateway", "worker"])
def test_a_process_given_no_password_for_a_redis_that_wants_one_exits_naming_the_setting(
    process: str, redis_with_password: int, tmp_path: Path
) -> None:
    url = f"redis://127.0.0.1:{redis_with_password}/0"

    exited = STARTS[process](tmp_path, ORTFLEET_REDIS_URL=url)

    assert_one_line(exited, f"ortfleet-{process}", url, "password", "ORTFLEET_REDIS_URL")


@pytest.mark.parametrize("process", ["gateway", "worker"])
def test_a_process_given_a_wrong_redis_password_exits_without_showing_it(
    process: str, redis_with_password: int, tmp_path: Path
) -> None:
    wrong = "not-" + PASSWORD

    exited = STARTS[process](
        tmp_path, ORTFLEET_REDIS_URL=f"redis://:{wrong}@127.0.0.1:{redis_with_password}/0"
    )

    masked = f"redis://:****@127.0.0.1:{redis_with_password}/0"
    assert_one_line(exited, f"ortfleet-{process}", masked, "password", "ORTFLEET_REDIS_URL")
    assert wrong not in exited.stderr
