"""Redis is checked, not trusted: a Redis that evicts keys is refused at start (unless allowed), one that
persists nothing or hides its settings is said to be so (log, /readyz, metrics), and a policy changed
while the fleet runs makes /readyz say so."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from redis import Redis as SyncRedis

from common.stores import Store
from ortfleet.fleet.processes import free_port, start_redis, stop
from tests.conftest import Fleet, RedisServer, keys
from tests.test_startup_mistakes import (
    HANG_GUARD_S,
    PASSWORD,
    STARTS,
    assert_one_line,
    clean_env,
    first_answer,
)
from tests.waiting import until


@dataclass
class RunningGateway:
    url: str
    stderr: Path

    def log(self) -> str:
        return self.stderr.read_text()


@contextmanager
def redis_with(tmp_path: Path, *options: str, appendonly: bool = True) -> Iterator[str]:
    """A redis-server started with `options`; its URL."""
    port = free_port()
    process = start_redis(port, tmp_path / "redis", appendonly=appendonly, options=options)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(process)


@contextmanager
def gateway_on(redis_url: str, tmp_path: Path, **settings: str) -> Iterator[RunningGateway]:
    """A gateway process on `redis_url`, answering /readyz; its stderr is kept in a file."""
    port = free_port()
    stderr = tmp_path / f"gateway-{port}.log"
    with stderr.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--port", str(port)],
            env=clean_env(ORTFLEET_REDIS_URL=redis_url, **settings),
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        first_answer(f"{url}/readyz", process)
        yield RunningGateway(url, stderr)
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("process", ["gateway", "worker"])
@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_a_process_on_a_redis_that_evicts_keys_exits_naming_the_policy_and_the_way_out(
    process: str, policy: str, tmp_path: Path
) -> None:
    with redis_with(tmp_path, "--maxmemory", "20mb", "--maxmemory-policy", policy) as url:
        exited = STARTS[process](tmp_path, ORTFLEET_REDIS_URL=url)

    assert_one_line(
        exited, f"ortfleet-{process}", policy, "noeviction", "ORTFLEET_ALLOW_EVICTING_REDIS", "127.0.0.1"
    )


@pytest.mark.parametrize("process", ["gateway", "worker"])
def test_a_process_given_a_node_of_a_cluster_that_serves_no_slot_exits_saying_so_and_the_way_out(
    process: str, tmp_path: Path
) -> None:
    nodes = tmp_path / "nodes.conf"
    # the cluster bus on a free port of its own (by default the port + 10000, past 65535 for a high one)
    bus = str(free_port())
    cluster = ("--cluster-enabled", "yes", "--cluster-config-file", str(nodes), "--cluster-port", bus)
    with redis_with(tmp_path, *cluster) as url:
        exited = STARTS[process](tmp_path, ORTFLEET_REDIS_URL=url)

    assert_one_line(exited, f"ortfleet-{process}", "Redis Cluster", "cluster_state: fail", "127.0.0.1")


@pytest.mark.parametrize("process", ["gateway", "worker"])
def test_a_redis_cluster_node_among_a_models_stores_stops_the_process_naming_the_store_by_position(
    process: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    # A worker choosing its store itself (ORTFLEET_STORE 0) does not pass over a mistake in the map.
    nodes = tmp_path / "nodes.conf"
    bus = str(free_port())
    cluster = ("--cluster-enabled", "yes", "--cluster-config-file", str(nodes), "--cluster-port", bus)
    with redis_with(tmp_path, *cluster, "--requirepass", PASSWORD) as url:
        stores = json.dumps({"fake": [redis_server.url, url.replace("redis://", f"redis://:{PASSWORD}@")]})
        exited = STARTS[process](
            tmp_path, ORTFLEET_REDIS_URL=redis_server.url, ORTFLEET_REDIS_SHARDS=stores, ORTFLEET_STORE="0"
        )

    assert_one_line(
        exited,
        f"ortfleet-{process}",
        "store 2 of 2 of model 'fake'",
        "Redis Cluster",
        "ORTFLEET_REDIS_SHARDS[fake][1]",
    )
    assert PASSWORD not in exited.stderr


def test_a_worker_choosing_its_store_passes_over_one_that_does_not_answer_and_says_which(
    redis_server: RedisServer, model_name: str, tmp_path: Path
) -> None:
    down = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    fleet = Fleet(redis_server.url, tmp_path)  # no model folder: --fake-engine loads none
    shards = json.dumps({model_name: [down, redis_server.url]})
    env = {"ORTFLEET_REDIS_SHARDS": shards, "ORTFLEET_STORE": "0"}
    try:
        worker = fleet.start_worker(model_name, "--fake-engine", "1:1", env=env, wait=False)
        fleet.wait_registered(worker, stores=[Store(redis_server.url, keys)])  # on store 2
        log = "\n".join(worker.last_lines())
    finally:
        fleet.stop_all()

    warnings = [line for line in log.splitlines() if "WARNING" in line and "store 1 of 2" in line]
    assert (
        warnings and "unreachable" in warnings[0] and f"ORTFLEET_REDIS_SHARDS[{model_name}][0]" in warnings[0]
    ), log
    assert "serving store 2 of 2" in log and PASSWORD not in log


def test_a_gateway_allowed_an_evicting_redis_starts_and_says_keys_may_be_lost(tmp_path: Path) -> None:
    with (
        redis_with(tmp_path, "--maxmemory-policy", "allkeys-lru") as url,
        gateway_on(url, tmp_path, ORTFLEET_ALLOW_EVICTING_REDIS="true") as gateway,
    ):
        ready = httpx.get(f"{gateway.url}/readyz").json()
        metrics = httpx.get(f"{gateway.url}/metrics").text

    assert ready["reason"] == "no live worker"
    assert any("allkeys-lru" in warning and "may be lost" in warning for warning in ready["warnings"])
    assert "ORTFLEET_ALLOW_EVICTING_REDIS" in gateway.log()
    evicting = next(line for line in metrics.splitlines() if line.startswith("ortfleet_redis_evicting{"))
    assert evicting.startswith('ortfleet_redis_evicting{redis="redis://127.0.0.1'), evicting
    assert evicting.endswith(" 1.0"), evicting


def test_a_redis_without_persistence_is_a_warning_a_metric_and_a_readyz_detail(tmp_path: Path) -> None:
    with redis_with(tmp_path, appendonly=False) as url, gateway_on(url, tmp_path) as gateway:
        ready = httpx.get(f"{gateway.url}/readyz").json()
        metrics = httpx.get(f"{gateway.url}/metrics").text

    said = [line for line in gateway.log().splitlines() if "persists nothing" in line]
    assert len(said) == 1 and "WARNING" in said[0] and "appendonly yes" in said[0], gateway.log()
    assert any("persists nothing" in warning for warning in ready["warnings"]), ready
    persistent = next(line for line in metrics.splitlines() if line.startswith("ortfleet_redis_persistent{"))
    assert persistent.endswith(" 0.0"), persistent


def test_answers_name_a_store_by_its_number_and_only_the_log_says_where_it_is(tmp_path: Path) -> None:
    port = free_port()
    process = start_redis(port, tmp_path / "redis", appendonly=False)
    address = f"127.0.0.1:{port}"
    try:
        with gateway_on(f"redis://{address}/0", tmp_path) as gateway:
            ready = httpx.get(f"{gateway.url}/readyz").json()
            fleet = httpx.get(f"{gateway.url}/v1/fleet").json()
            stop(process)
            gone = httpx.get(f"{gateway.url}/readyz")
            log = gateway.log()
    finally:
        stop(process)

    for line in [*ready["warnings"], *fleet["store"]]:
        assert "store 1" in line and "persists nothing" in line and str(port) not in line, line
    assert gone.status_code == 503 and "Redis is unreachable (store 1)" in gone.json()["reason"]
    assert str(port) not in gone.text and "127.0.0.1" not in gone.text, gone.text
    assert address in log  # the operator reads where it is in the gateway's log


def test_a_redis_whose_config_and_info_commands_are_disabled_is_said_to_be_unchecked(tmp_path: Path) -> None:
    with (
        redis_with(tmp_path, "--rename-command", "CONFIG", "", "--rename-command", "INFO", "") as url,
        gateway_on(url, tmp_path) as gateway,
    ):
        ready = httpx.get(f"{gateway.url}/readyz").json()
        metrics = httpx.get(f"{gateway.url}/metrics").text

    said = [line for line in gateway.log().splitlines() if "could not be checked" in line]
    assert len(said) == 1 and "noeviction" in said[0], gateway.log()
    assert "Traceback" not in gateway.log()
    assert any("could not be checked" in warning for warning in ready["warnings"]), ready
    checked = next(line for line in metrics.splitlines() if line.startswith("ortfleet_redis_config_checked{"))
    assert checked.endswith(" 0.0"), checked


def test_the_suites_own_redis_passes_the_check_with_nothing_to_say(tmp_path: Path) -> None:
    with redis_with(tmp_path) as url, gateway_on(url, tmp_path) as gateway:
        ready = httpx.get(f"{gateway.url}/readyz").json()

    assert "warnings" not in ready, ready
    assert "WARNING" not in gateway.log(), gateway.log()


async def test_an_evicting_policy_set_while_the_gateway_runs_makes_it_not_ready(tmp_path: Path) -> None:
    with redis_with(tmp_path) as url, gateway_on(url, tmp_path) as gateway:
        with SyncRedis.from_url(url) as admin:
            admin.config_set("maxmemory-policy", "allkeys-lfu")

        async with httpx.AsyncClient() as client:
            reply = await client.get(f"{gateway.url}/readyz")
        assert reply.status_code == 503
        assert "allkeys-lfu" in reply.json()["reason"], reply.json()
        await until(lambda: "allkeys-lfu" in gateway.log(), "the change logged", HANG_GUARD_S)


def test_a_redis_started_with_its_log_in_a_folder_not_made_yet_starts_and_logs_there(tmp_path: Path) -> None:
    """redis-server exits at once when its log file's folder is missing (a fresh ORTFLEET_TEST_LOGS did it
    to every test of a GPU run): start_redis makes the folder."""
    port = free_port()
    log = tmp_path / "not" / "made" / "redis.log"
    process = start_redis(port, tmp_path / "data", appendonly=False, log=log)
    try:
        assert SyncRedis(port=port).ping() and log.stat().st_size > 0
    finally:
        stop(process)
