"""The one way to run a fleet on this machine: redis-server, gateways and workers as child processes,
watched for exits and stopped in order. `ortfleet up`, the benchmarks, the fault drills and the test
fixtures all start their processes here."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import IO, Literal

from pydantic_settings import SettingsError

from common.redis_client import cluster_node, connect_blocking
from common.stores import Store, home_store
from common.worker_settings import WorkerSettings
from ortfleet.fleet.process_server import ProcessServer
from ortfleet.fleet.processes import (
    ChildProcess,
    StartupError,
    child_env,
    free_port,
    gateway_command,
    start_redis,
    stop,
    wait_for_port,
    wait_ready,
    worker_command,
)
from ortfleet.fleet.redis_cluster import RedisCluster

Role = Literal["redis", "gateway", "worker", "core"]
LineSink = Callable[[str, str], None]
LOG_TAIL_LINES = 20
GATEWAY_STOP_S = 15.0
REDIS_STOP_S = 15.0
CORE_STOP_S = 15.0  # a shared engine core, once its workers have gone
# Past a worker's shutdown grace: time to hand back its jobs and exit before it is killed.
WORKER_STOP_MARGIN_S = 10.0
GRACE_VARIABLE = "ORTFLEET_SHUTDOWN_GRACE_S"


@dataclass
class FleetProcess:
    """One child process of a local fleet. Its output goes to `log`, or line by line to the fleet's sink
    (then `log` is None and the last lines are kept in `tail`)."""

    name: str
    role: Role
    process: ChildProcess
    log: Path | None
    url: str = ""
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    grace_s: float = 0.0  # a worker's shutdown grace, as it reads its settings
    output: IO[bytes] | None = None  # where `log` is None: its output, read line by line

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def last_lines(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        if self.log is None:
            return list(self.tail)[-lines:]
        if not self.log.is_file():
            return []
        return self.log.read_text(errors="replace").splitlines()[-lines:]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.last_lines(lines))

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


class LocalFleet:
    """Starts the processes of a fleet against one Redis (its own, or `redis_url`) and stops all of them
    on `stop_all` (or on leaving a `with`): gateways first, then workers, which hand their running jobs
    back, then Redis.

    Each child runs in a process group of its own, so a terminal's Ctrl-C reaches only the parent, which
    stops them in that order. With `output`, each line a child prints is passed to it as (name, line);
    otherwise it goes to a log file in `log_dir`. With `process_server` (and no `output`), gateways, workers
    and engine cores are forked from that server (ortfleet/fleet/process_server.py), their imports paid
    once, rather than started afresh.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        model_dir: Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        output: LineSink | None = None,
        process_server: ProcessServer | None = None,
    ) -> None:
        self.redis_url = redis_url or ""
        self.model_dir = model_dir
        self.env = dict(env or {})
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="ortfleet-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.output = output
        self.process_server = process_server
        self.processes: list[FleetProcess] = []
        self.exits: SimpleQueue[FleetProcess] = SimpleQueue()
        self.stopping = False
        self.gateway_url = ""
        self.cluster: RedisCluster | None = None  # the fleet's Redis, where it started a cluster of its own
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    @property
    def gateways(self) -> list[FleetProcess]:
        return self._role("gateway")

    @property
    def workers(self) -> list[FleetProcess]:
        return self._role("worker")

    def start_redis(
        self, *, appendonly: bool = True, data_dir: Path | None = None, home: bool = True
    ) -> FleetProcess:
        """A redis-server of the fleet's own on a free port (AOF on unless `appendonly` is False): the
        fleet's Redis, or with `home` False one more (a store of a model, given to processes in
        ORTFLEET_REDIS_SHARDS)."""
        port = free_port()
        log = self.log_dir / f"redis-{port}.log"
        data = data_dir or self.log_dir / f"redis-{port}"
        process = start_redis(port, data, appendonly=appendonly, log=log)
        url = f"redis://127.0.0.1:{port}/0"
        if home:
            self.redis_url = url
        return self._adopt(FleetProcess("redis", "redis", process, log, url=url))

    def start_redis_cluster(
        self, primaries: int, replicas_each: int = 0, *, appendonly: bool = True
    ) -> RedisCluster:
        """A Redis Cluster of the fleet's own on free ports, `primaries` primaries with `replicas_each`
        replicas each: the fleet's Redis (the URL of its first node); stopped with the fleet."""
        cluster = RedisCluster(
            self.log_dir / f"redis-cluster-{len(self.processes)}", self.log_dir, appendonly
        )
        try:
            cluster.start(primaries, replicas_each)
        except BaseException:
            cluster.stop_all()
            raise
        for port, node in cluster.nodes.items():
            assert node.process is not None
            log = self.log_dir / f"redis-cluster-{port}.log"
            self._adopt(FleetProcess("redis", "redis", node.process, log, url=f"redis://127.0.0.1:{port}/0"))
        self.redis_url = cluster.url
        self.cluster = cluster
        return cluster

    def spread_model(
        self, model: str, stores: int, *, appendonly: bool = True, data_dir: Path | None = None
    ) -> list[str]:
        """Gives `model` `stores` Redis stores, in the environment of every process started after
        (ORTFLEET_REDIS_SHARDS): on the fleet's Redis Cluster (start_redis_cluster), as many hash tags;
        else the fleet's Redis the first and the others started now (their data in `data_dir`/store-N, if
        given). The URLs of the Redis servers that hold them (a cluster's primaries)."""
        if self.cluster is not None:
            shards = json.loads(self.env.get("ORTFLEET_REDIS_SHARDS", "{}"))
            self.env["ORTFLEET_REDIS_SHARDS"] = json.dumps({**shards, model: stores})
            return [f"redis://127.0.0.1:{port}/0" for port in self.cluster.primary_ports()]
        extra = [
            self.start_redis(
                appendonly=appendonly, home=False, data_dir=data_dir / f"store-{n}" if data_dir else None
            ).url
            for n in range(2, stores + 1)
        ]
        urls = [self.redis_url, *extra]
        shards = json.loads(self.env.get("ORTFLEET_REDIS_SHARDS", "{}"))
        self.env["ORTFLEET_REDIS_SHARDS"] = json.dumps({**shards, model: urls})
        return urls

    def start_gateway(
        self,
        env: Mapping[str, str] | None = None,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        shared: bool = False,
    ) -> tuple[FleetProcess, str]:
        """A gateway on `port` (a free one by default), once it listens; the process and its base URL.
        `shared`: the port is shared with the fleet's other gateways (ORTFLEET_REUSE_PORT)."""
        port = port or free_port()
        if shared:
            env = {**(env or {}), "ORTFLEET_REUSE_PORT": "true"}
        child = self._spawn("gateway", "gateway", gateway_command(port, host=host), env)
        wait_for_port(port, child.process, "the gateway")
        child.url = f"http://127.0.0.1:{port}"
        self.gateway_url = self.gateway_url or child.url
        return child, child.url

    def start_gateways(self, count: int, *, port: int, host: str = "127.0.0.1") -> list[FleetProcess]:
        """`count` gateways on the one `port`, sharing it when there are several (start_gateway)."""
        return [self.start_gateway(port=port, host=host, shared=count > 1)[0] for _ in range(count)]

    def start_worker(
        self,
        name: str,
        *extra: str,
        model: Path | None = None,
        device: str = "auto",
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        timeout_s: float = 60.0,
        label: str | None = None,
    ) -> FleetProcess:
        """A worker serving `model` (the fleet's model by default) as `name`. With `wait`, returns once this
        very process has registered as live (a dead worker's entry, still live until its heartbeat runs out,
        does not count)."""
        model_dir = model or self.model_dir or Path(".")
        command = worker_command(model_dir, name=name, device=device, extra=extra)
        child = self._spawn(label or f"worker-{name}", "worker", command, env)
        child.grace_s = worker_grace_s({**self.env, **(env or {})})
        if wait:
            self.wait_registered(child, timeout_s=timeout_s, stores=self.stores_for(name, env))
        return child

    def start_core(
        self,
        socket_path: Path,
        frontends: int,
        *extra: str,
        model: Path | None = None,
        device: str = "auto",
        env: Mapping[str, str] | None = None,
        label: str = "core",
    ) -> FleetProcess:
        """An engine core serving `frontends` workers that connect at `socket_path` (their
        ORTFLEET_ENGINE_CORE is `unix:` and the path), with `model` (the fleet's by default) on `device`."""
        model_dir = model or self.model_dir or Path(".")
        command = [
            sys.executable, "-m", "worker.core", "--socket", str(socket_path), "--frontends", str(frontends),
            "--model", str(model_dir), "--device", device, *extra,
        ]  # fmt: skip
        return self._spawn(label, "core", command, env)

    def stores_for(self, model: str, env: Mapping[str, str] | None = None) -> list[Store]:
        """The stores a worker of `model` may register on: its stores, if ORTFLEET_REDIS_SHARDS gives it
        some (the one ORTFLEET_STORE names, if it names one), on a Redis Cluster where the fleet's Redis
        is one."""
        given = {**os.environ, **self.env, **(env or {})}
        shards = given.get("ORTFLEET_REDIS_SHARDS")
        settings = WorkerSettings(
            redis_url=self.redis_url,
            redis_shards=json.loads(shards) if shards else {},
            store=int(given.get("ORTFLEET_STORE") or 0),
        )
        stores = settings.stores_for(model, cluster_node(self.redis_url))
        return [stores[settings.store - 1]] if 0 < settings.store <= len(stores) else stores

    def wait_registered(
        self, child: FleetProcess, *, timeout_s: float = 60.0, stores: list[Store] | None = None
    ) -> None:
        """Until the worker process `child` has a live entry in the registry of one of `stores` (the
        fleet's Redis by default)."""
        deadline = time.monotonic() + timeout_s
        with contextlib.ExitStack() as stack:
            stores = stores or [home_store(self.redis_url, cluster_node(self.redis_url))]
            redises = [
                (stack.enter_context(connect_blocking(store.url, cluster=store.cluster)), store.keys)
                for store in stores
            ]
            while time.monotonic() < deadline:
                if not child.alive():
                    raise StartupError(
                        f"{child.name} exited with code {child.process.returncode}:\n{child.log_tail()}"
                    )
                now_ms = int(time.time() * 1000)
                for redis, keys in redises:
                    for worker_id in redis.zrangebyscore(keys.workers, now_ms, "+inf"):
                        if redis.hget(keys.worker(worker_id), "pid") == str(child.pid):
                            return
                time.sleep(0.05)
        raise StartupError(f"{child.name} did not register within {timeout_s:g} s:\n{child.log_tail()}")

    def wait_workers(
        self, model: str, count: int, *, timeout_s: float = 300.0, watched: FleetProcess | None = None
    ) -> None:
        """Until the first gateway sees `count` live workers of `model`; shows the log of a worker that
        did not come up."""
        try:
            gateway = self.gateways[0].process if self.gateways else None
            wait_ready(self.gateway_url, gateway, workers=count, model=model, timeout_s=timeout_s)
        except Exception as e:
            shown = watched or (self.workers[-1] if self.workers else None)
            if shown is not None:
                e.add_note(f"last lines of {shown.name}:\n{shown.log_tail()}")
            raise

    def await_workers(
        self, model: str, count: int, started: list[FleetProcess], *, timeout_s: float = 300.0
    ) -> None:
        """Until `count` workers of `model` are live; StartupError with the end of its log as soon as a
        gateway or one of `started` exits (rather than when the time runs out), or with the last worker's
        at the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            exited = next((child for child in [*self.gateways, *started] if not child.alive()), None)
            if exited is not None:
                raise StartupError(
                    f"{exited.name} exited with code {exited.process.returncode} before it was live:\n"
                    f"{exited.log_tail()}"
                )
            try:
                wait_ready(
                    self.gateway_url, self.gateways[0].process, workers=count, model=model, timeout_s=1.0
                )
                return
            except StartupError as e:
                if time.monotonic() > deadline:
                    raise StartupError(f"{e}\n{started[-1].log_tail()}") from e

    def unexpected_exit(self) -> FleetProcess | None:
        """A child that exited while the fleet was not stopping, if any."""
        if self.stopping:
            return None
        return next((child for child in self.processes if not child.alive()), None)

    def wait_for_exit(self, poll_s: float = 1.0) -> FleetProcess:
        """Blocks until a child exits; that child."""
        while True:
            with contextlib.suppress(Empty):
                return self.exits.get(timeout=poll_s)

    def stop_all(self, say: Callable[[str], None] | None = None) -> None:
        """Gateways first, then every worker at once (each hands its running jobs back to the queue once
        its shutdown grace has run out, and is killed `WORKER_STOP_MARGIN_S` after that), then the
        shared engine cores, then Redis."""
        self.stopping = True
        for child in self.gateways:
            stop(child.process, GATEWAY_STOP_S)
        workers = [child for child in self.workers if child.alive()]
        if workers and say is not None:
            say(f"stopping {len(workers)} worker(s); running jobs are handed back to the queue")
        signalled = time.monotonic()
        for child in workers:
            child.process.terminate()
        for child in workers:
            deadline = signalled + child.grace_s + WORKER_STOP_MARGIN_S
            stop(child.process, max(0.0, deadline - time.monotonic()))
        for child in self._role("core"):
            stop(child.process, CORE_STOP_S)
        for child in self._role("redis"):
            stop(child.process, REDIS_STOP_S)
        for thread in self._threads:
            thread.join(timeout=2.0)

    def kill_all(self) -> None:
        for child in self.processes:
            if child.alive():
                child.process.kill()

    def _spawn(
        self, name: str, role: Role, command: list[str], env: Mapping[str, str] | None
    ) -> FleetProcess:
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(env or {})}
        if self.redis_url:
            environment.update(child_env(self.redis_url))
        if self.output is None:
            log: Path | None = self.log_dir / f"{name}-{len(self.processes)}-{os.getpid()}.log"
            assert log is not None
            with log.open("wb") as handle:
                process: ChildProcess
                if self.process_server is not None and command[:2] == [sys.executable, "-m"]:
                    process = self.process_server.start(command[2:], env=environment, output=handle.fileno())
                else:
                    process = subprocess.Popen(
                        command, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                        env=environment, process_group=0,
                    )  # fmt: skip
        else:
            piped = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=environment, process_group=0,
            )  # fmt: skip
            return self._adopt(FleetProcess(name, role, piped, None, output=piped.stdout))
        return self._adopt(FleetProcess(name, role, process, log))

    def _adopt(self, child: FleetProcess) -> FleetProcess:
        self.processes.append(child)
        watch = self._forward if child.log is None else self._await_exit
        thread = threading.Thread(target=watch, args=(child,), name=f"watch-{child.name}", daemon=True)
        self._threads.append(thread)
        thread.start()
        return child

    def _forward(self, child: FleetProcess) -> None:
        assert child.output is not None and self.output is not None
        for raw in child.output:
            line = raw.decode(errors="replace").rstrip()
            child.tail.append(line)
            self.output(child.name, line)
        self._await_exit(child)

    def _await_exit(self, child: FleetProcess) -> None:
        child.process.wait()
        self.exits.put(child)

    def _role(self, role: Role) -> list[FleetProcess]:
        return [child for child in self.processes if child.role == role]


def worker_grace_s(overrides: Mapping[str, str]) -> float:
    """The shutdown grace (ORTFLEET_SHUTDOWN_GRACE_S) of a worker started with `overrides` on top of this
    process's environment: it reads its settings as this process would, from there, then the .env file."""
    given = [value for name, value in overrides.items() if name.upper() == GRACE_VARIABLE]
    try:
        settings = WorkerSettings(shutdown_grace_s=float(given[-1])) if given else WorkerSettings()
    except (ValueError, SettingsError):  # pydantic's ValidationError too; such a worker does not start
        return float(WorkerSettings.model_fields["shutdown_grace_s"].default)
    return settings.shutdown_grace_s


def throwaway_fleet(env: Mapping[str, str] | None = None, *, cluster: int = 0) -> LocalFleet:
    """A fleet for a benchmark or a drill: quiet logs and a redis-server of its own that keeps nothing
    (with `cluster`, a Redis Cluster of that many primaries, without replicas)."""
    fleet = LocalFleet(env={"ORTFLEET_LOG_LEVEL": "warning", **(env or {})})
    if cluster:
        fleet.start_redis_cluster(cluster, appendonly=False)
    else:
        fleet.start_redis(appendonly=False)
    return fleet


@contextlib.contextmanager
def serving_fleet(
    model_dir: Path,
    name: str,
    workers: int = 1,
    *,
    env: Mapping[str, str] | None = None,
    worker_args: tuple[str, ...] = (),
    device: str = "auto",
    gateways: int = 1,
    shared_core: bool = False,
) -> Iterator[str]:
    """A throwaway fleet (`gateways` gateways sharing one port and `workers` workers serving the model
    as `name` on `device`, every process with `env`; with `shared_core`, the workers are the frontends of
    one engine core) once its workers are ready; yields the gateway's URL. A worker that cannot start
    shows the end of its log."""
    with throwaway_fleet(env) as fleet, tempfile.TemporaryDirectory(prefix="ortfleet-core-") as sockets:
        fleet.start_gateways(gateways, port=free_port())
        attach: dict[str, str] = {}
        if shared_core:
            socket_path = Path(sockets) / "core.sock"
            fleet.start_core(socket_path, workers, *worker_args, model=model_dir, device=device)
            attach = {"ORTFLEET_ENGINE_CORE": f"unix:{socket_path}"}
        started = [
            fleet.start_worker(name, *worker_args, model=model_dir, device=device, env=attach, wait=False)
            for _ in range(workers)
        ]
        fleet.await_workers(name, workers, started)
        yield fleet.gateway_url
