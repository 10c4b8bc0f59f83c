"""Fixtures that start real parts: a redis-server, worker processes on a tiny model, gateways."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, cast

import httpx
import openai
import pytest
from redis.asyncio import Redis

from common.keys import HOME_TAG, STANDALONE, Keyspace
from common.redis_client import connect
from common.settings import FleetSettings
from ortfleet.fleet.launcher import FleetProcess, LocalFleet
from ortfleet.fleet.process_server import ProcessServer
from ortfleet.fleet.processes import free_port, start_redis, stop
from ortfleet.fleet.redis_cluster import RedisCluster
from tests.openai_schema import OpenAISchema, install

if TYPE_CHECKING:
    from ortfleet.modelbuild.build_server import BuilderServer
    from tests.sentinel_group import SentinelGroup
    from worker.engines.batcher.engine import BatchingEngine

# start_worker: fake-engine worker services; model: a model name of the test's own for jobs put on the queue
pytest_plugins = ["tests.fake_workers", "tests.queued_jobs"]

# Answers of OpenAI routes that do not match OpenAI's OpenAPI document, since the running test began.
SCHEMA_MISMATCHES: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    install(OpenAISchema(), SCHEMA_MISMATCHES.append)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    SCHEMA_MISMATCHES.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Fails a test that read an answer of an OpenAI route which OpenAI's OpenAPI document refuses."""
    yield
    if SCHEMA_MISMATCHES:
        seen = list(dict.fromkeys(SCHEMA_MISMATCHES))
        SCHEMA_MISMATCHES.clear()
        shown = "\n".join(seen[:10]) + (f"\n... and {len(seen) - 10} more" if len(seen) > 10 else "")
        raise AssertionError(f"answers that do not match OpenAI's OpenAPI document:\n{shown}")


LOGS = Path(os.environ.get("ORTFLEET_TEST_LOGS", tempfile.mkdtemp(prefix="ortfleet-test-logs-")))
LOGS.mkdir(parents=True, exist_ok=True)  # a folder named by ORTFLEET_TEST_LOGS may not exist yet


# ORTFLEET_TEST_REDIS=cluster: the session's Redis (redis_server, and the fleets and clients made on it)
# is a Redis Cluster of three primaries, the fleet's home data and every model without stores of its own
# under the home hash tag; `keys` names that keyspace, as the processes name it.
CLUSTER = os.environ.get("ORTFLEET_TEST_REDIS", "") == "cluster"
keys = Keyspace(HOME_TAG) if CLUSTER else STANDALONE


@dataclass
class RedisServer:
    port: int
    data_dir: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop(self.process)

    def start(self) -> None:
        """Starts it again on the same port and data (its AOF) after `stop`."""
        self.process = start_redis(self.port, self.data_dir, log=LOGS / f"redis-{self.port}.log")


def _start_redis_server(data: Path) -> RedisServer:
    port = free_port()
    return RedisServer(port, data, start_redis(port, data, log=LOGS / f"redis-{port}.log"))


@dataclass
class ClusterServer:
    """The session's Redis as a Redis Cluster (ORTFLEET_TEST_REDIS=cluster): `url` names its first node."""

    cluster: RedisCluster

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def port(self) -> int:
        return self.cluster.ports[0]


@pytest.fixture
async def engines() -> AsyncIterator[list[BatchingEngine]]:
    """The engines a test opens in its process (it appends each), closed once it ends."""
    made: list[BatchingEngine] = []
    yield made
    for engine in made:
        engine.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if CLUSTER:
        cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"), LOGS)
        try:
            cluster.start(primaries=3, replicas_each=0)
            yield cast(RedisServer, ClusterServer(cluster))
        finally:
            cluster.stop_all()
        return
    server = _start_redis_server(tmp_path_factory.mktemp("redis"))
    yield server
    stop(server.process)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelGroup]:
    """A Redis primary, its replica and three Sentinels watching them (tests/sentinel_group.py)."""
    from tests.sentinel_group import SentinelGroup

    group = SentinelGroup(tmp_path)
    try:
        group.primary_port = group.start_redis()
        group.replica_port = group.start_redis("--replicaof", "127.0.0.1", str(group.primary_port))
        for _ in range(3):
            group.start_sentinel()
        group.wait_until(group.replica_synced, "the replica has synced with the primary")
        group.wait_until(group.watching, "the sentinels watch the primary, its replica and each other")
        yield group
    finally:
        group.stop_all()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own (AOF on): to restart, or to keep data apart from other tests."""
    server = _start_redis_server(tmp_path / "redis")
    yield server
    stop(server.process)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A client of the session's Redis: on a cluster, of the home tag's primary."""
    client = connect(redis_server.url, tag=keys.tag)
    yield client
    await client.aclose()


@pytest.fixture
async def own_redis_client(own_redis: RedisServer) -> AsyncIterator[Redis]:
    client = connect(own_redis.url)
    yield client
    await client.aclose()


def kept_models(name: str) -> Path:
    """A folder for models the tests build, beside the model cache (test-models/ next to models/), so
    that every checkout and run of the suite on a machine shares them: `name` carries a key of what
    their build depends on, so a change to a builder or to a library it is built with builds them
    again. The builds write a partial folder and rename it, under a lock (ortfleet/modelbuild/cache.py)."""
    folder = FleetSettings().model_cache.parent / "test-models" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny model, kept between runs (kept_models). tests/test_model_build.py builds it afresh."""
    from ortfleet.modelbuild.tiny import build_tiny_model

    return build_tiny_model(kept_models(f"tiny-model-{_tiny_build_key()}") / "tiny")


@pytest.fixture(scope="session")
def model_builder() -> Iterator[BuilderServer]:
    """One builder server for the session (ortfleet/modelbuild/build_server.py), started at the first
    build of a module that enters it (builder_server): torch, transformers and the builder are imported
    once, not in a fresh interpreter per build (about 20 s each on a 2-vCPU VM)."""
    from ortfleet.modelbuild.build_server import BuilderServer
    from ortfleet.modelbuild.convert import offline_environ

    server = BuilderServer(env=offline_environ())
    yield server
    server.close()


@pytest.fixture(scope="module")
def builder_server(model_builder: BuilderServer) -> Iterator[BuilderServer]:
    """The session's builder server, through which run_builder runs the module's builds."""
    from ortfleet.modelbuild.convert import builder_server

    with builder_server(model_builder):
        yield model_builder


def _tiny_build_key() -> str:
    from ortfleet.modelbuild import cache, convert, tiny

    digest = hashlib.sha256()
    for module in (tiny, convert, cache):
        digest.update(Path(module.__file__ or "").read_bytes())
    for package in (
        "onnxruntime-genai",
        "onnxruntime-genai-cuda",
        "torch",
        "transformers",
        "tokenizers",
        "onnx-ir",
        "onnxscript",
        "onnxruntime",
    ):
        try:
            digest.update(f"{package}=={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package} missing".encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model (SmolLM2-135M-Instruct int4, CPU), built into the model cache if need be."""
    from ortfleet.modelbuild.default import ensure_default_model

    return ensure_default_model(FleetSettings().model_cache)


Proc = FleetProcess


_FLEETS = itertools.count(1)


def fleet_log_dir() -> Path:
    """A folder of the test logs for one fleet, named after the test that starts it (and numbered, as
    one test may start several), so a later fleet's logs never overwrite an earlier one's."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "fleet").split(" ")[0]
    return LOGS / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', test)[-120:]}-{next(_FLEETS)}"


# A test's worker, stopped, hands its running jobs back at once: with the default grace (30 s) a job still
# generating at the end of a test held its teardown until the stop gave up and killed the worker. Tests of
# the grace set ORTFLEET_SHUTDOWN_GRACE_S for their workers.
TEST_FLEET_ENV = {"ORTFLEET_SHUTDOWN_GRACE_S": "0"}


# The tests' gateways, workers and engine cores are forked from one process server per test process
# (ortfleet/fleet/process_server.py), which paid their imports once: 0.7-1 s of CPU saved on each of some
# 650 processes a run. ORTFLEET_TEST_PROCESS_SERVER=false starts each afresh instead.
_PROCESS_SERVER: ProcessServer | None = None


def process_server() -> ProcessServer | None:
    global _PROCESS_SERVER
    if os.environ.get("ORTFLEET_TEST_PROCESS_SERVER", "true").lower() in {"0", "false", "no"}:
        return None
    if _PROCESS_SERVER is None:
        _PROCESS_SERVER = ProcessServer()
    return _PROCESS_SERVER


@pytest.fixture(scope="session", autouse=True)
def _close_process_server() -> Iterator[None]:
    yield
    if _PROCESS_SERVER is not None:
        _PROCESS_SERVER.close()


class Fleet(LocalFleet):
    """Gateways and workers against the test's Redis, logging to a folder of the test logs of their
    own (fleet_log_dir), forked from the test process's process server; stops what it started."""

    def __init__(self, redis_url: str, model_dir: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(
            redis_url,
            model_dir,
            env={**TEST_FLEET_ENV, **(env or {})},
            log_dir=fleet_log_dir(),
            process_server=process_server(),
        )


def _gateway_on(server: RedisServer, model_dir: Path) -> Iterator[Fleet]:
    fleet = Fleet(server.url, model_dir)
    fleet.start_gateway()
    yield fleet
    fleet.stop_all()


@pytest.fixture(scope="module")
def smollm2(redis_server: RedisServer, default_model: Path) -> Iterator[str]:
    """A gateway and a worker serving the default model as "smollm2", one fleet per test module; yields
    the gateway's URL."""
    fleet = Fleet(redis_server.url, default_model)
    try:
        fleet.start_gateway()
        fleet.start_worker("smollm2")
        yield fleet.gateway_url
    finally:
        fleet.stop_all()


@pytest.fixture
def fleet(request: pytest.FixtureRequest, redis_server: RedisServer, tiny_model: Path) -> Iterator[Fleet]:
    """A gateway of its own; each test starts the workers it needs under model names of its own.

    In a module marked `module_fleet` the gateway is the module's (module_gateway), started once for all
    of its tests, and what a test starts on this fleet (workers, gateways of other settings) stops when
    the test ends."""
    if request.node.get_closest_marker("module_fleet") is None:
        yield from _gateway_on(redis_server, tiny_model)
        return
    shared: Fleet = request.getfixturevalue("module_gateway")
    fleet = Fleet(shared.redis_url, tiny_model)
    fleet.gateway_url = shared.gateway_url
    yield fleet
    fleet.stop_all()


@pytest.fixture(scope="module")
def module_gateway(redis_server: RedisServer, tiny_model: Path) -> Iterator[Fleet]:
    """The gateway of a module marked `module_fleet`, for all of its tests (and the worker of `served`)."""
    yield from _gateway_on(redis_server, tiny_model)


@pytest.fixture
def own_fleet(own_redis: RedisServer, tiny_model: Path) -> Iterator[Fleet]:
    """A gateway on a Redis of the test's own: no other test's worker is ever live in its registry."""
    yield from _gateway_on(own_redis, tiny_model)


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=30) as http:
        yield http


@pytest.fixture
def served(request: pytest.FixtureRequest, fleet: Fleet, model_name: str) -> str:
    """The test's model name, served by one worker on the tiny model; in a module marked `module_fleet`,
    the module's model, served by one worker for all of its tests."""
    if request.node.get_closest_marker("module_fleet") is None:
        fleet.start_worker(model_name)
        return model_name
    name: str = request.getfixturevalue("module_served")
    return name


@pytest.fixture(scope="module")
def module_served(module_gateway: Fleet, request: pytest.FixtureRequest) -> str:
    """The model name of a module marked `module_fleet`, served by one worker behind its gateway."""
    module: str = request.module.__name__
    name = "tiny-module-" + module.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")
    module_gateway.start_worker(name)
    return name


@pytest.fixture
def sdk(fleet: Fleet) -> Iterator[openai.OpenAI]:
    """The official openai SDK pointed at the fleet's gateway."""
    with openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def model_name(request: pytest.FixtureRequest) -> str:
    """A served model name unique to the test, so tests never share a queue."""
    return "tiny-" + request.node.name.removeprefix("test_").replace("_", "-")[:40]
