"""`ortfleet up`: a whole local fleet (redis-server, workers, gateway) in one command."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError
from pydantic_settings import SettingsError

from common.gateway_settings import GatewaySettings
from common.redis_url import URL_FORMAT, mask_url
from common.startup import settings_error_lines
from common.worker_settings import WorkerSettings
from ortfleet.fleet.gpu_plan import GpuPlanError, PlannedWorker, nvidia_smi_gpus, plan_workers, planned_cores
from ortfleet.fleet.launcher import LocalFleet
from ortfleet.fleet.processes import (
    REDIS_MISSING,
    StartupError,
    free_port,
)
from ortfleet.fleet.prometheus_sd import file_sd_groups, write_file_sd
from ortfleet.fleet.supervisor import ChildExited, Console, FleetStopped, StopSignals

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers

STARTUP_TIMEOUT_S = 300.0
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start a whole local fleet: redis-server, workers and the gateway",
        description="Start redis-server, N workers and the gateway, wait until every worker is live, print "
        "the URLs and a curl example, and run until Ctrl-C, then stop everything.",
    )
    parser.add_argument(
        "--workers", metavar="N", type=_positive_int, help="worker processes on --device (default 1)"
    )
    parser.add_argument(
        "--gpus",
        metavar="all|I,J",
        help="one worker pinned to each of these GPUs (cuda:N) instead of --workers; all: every GPU "
        "nvidia-smi lists. Without --model, serves the default model built fp16 with paged attention",
    )
    parser.add_argument(
        "--workers-per-gpu",
        metavar="N",
        type=_positive_int,
        default=1,
        help="with --gpus: N workers on each GPU, the frontends of one engine core that holds the card's "
        "model and KV cache, each with 1/N of its rows (default 1: one worker and its own engine core)",
    )
    parser.add_argument(
        "--gateways",
        metavar="N",
        type=_positive_int,
        default=1,
        help="gateway processes sharing the port (SO_REUSEPORT): one relays a few tens of thousands of "
        "tokens/s, so a fast GPU wants several (default 1)",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        type=Path,
        help="ORT-GenAI model folder to serve (default: the default model, built if needed)",
    )
    parser.add_argument(
        "--name",
        metavar="NAME",
        help="served model name (default: smollm2 for the default model, else the folder's name)",
    )
    parser.add_argument(
        "--device", metavar="DEVICE", default="auto", help="auto, cpu, cuda or cuda:N (default auto)"
    )
    parser.add_argument(
        "--max-batch-size", metavar="N", type=_positive_int, help="engine batch rows of each worker"
    )
    parser.add_argument(
        "--lora",
        metavar="NAME=PATH",
        action="append",
        default=[],
        help="a PEFT LoRA adapter every worker serves beside the model, under NAME (repeatable; the CPU "
        "batcher only)",
    )
    parser.add_argument(
        "--host", metavar="HOST", default="127.0.0.1", help="gateway listen address (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port",
        metavar="PORT",
        type=int,
        default=8000,
        help="gateway port (default 8000; 0 picks a free one)",
    )
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="use this Redis instead of starting a redis-server (redis://[:password@]host:port/db)",
    )
    parser.add_argument(
        "--stores",
        metavar="N",
        type=_positive_int,
        default=1,
        help="spread the model's jobs over N stores, the workers over them in turn (ORTFLEET_REDIS_SHARDS, "
        "ORTFLEET_STORE): N redis-servers started here, or with --redis-url naming a Redis Cluster node, N "
        "hash tags on that cluster; at most one per worker (default 1)",
    )
    parser.add_argument(
        "--startup-timeout",
        metavar="SECONDS",
        type=float,
        default=STARTUP_TIMEOUT_S,
        help=f"seconds the workers get to become live (default {STARTUP_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--metrics-sd",
        metavar="FILE",
        type=Path,
        help="write the gateway's and each worker's /metrics address to FILE, a Prometheus file_sd JSON",
    )
    parser.set_defaults(func=run)


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


@dataclass(frozen=True)
class Served:
    model_dir: Path
    name: str


def run(args: argparse.Namespace) -> int:
    """Run `ortfleet up` until a signal or a child's death; the exit code."""
    console = Console()
    try:
        settings = _load_settings(args)
    except (ValidationError, SettingsError) as e:
        console.say("\n".join(f"ortfleet up: {line}" for line in settings_error_lines(e)))
        return 1
    fleet = LocalFleet(output=console.child_line)
    signals = StopSignals(fleet)
    data_dir: Path | None = None
    signals.install()
    try:
        if not args.redis_url and shutil.which("redis-server") is None:
            raise StartupError(REDIS_MISSING)
        port = args.port or free_port()
        _check_port_free(args.host, port)
        plan = _plan_workers(args)
        _check_stores(args, len(plan))
        served = _resolve_model(args, settings.model_cache, console)
        if args.redis_url:
            fleet.redis_url = args.redis_url
            cluster = _check_redis(fleet.redis_url, settings.allow_evicting_redis)
            if args.stores > 1 and not cluster:
                raise StartupError(
                    "--stores starts its own redis-servers, or spreads the model over hash tags of a "
                    f"Redis Cluster; {mask_url(args.redis_url)} is a standalone Redis: give the model its "
                    "stores in ORTFLEET_REDIS_SHARDS instead"
                )
            if args.stores > 1:
                fleet.env["ORTFLEET_REDIS_SHARDS"] = _with_cluster_stores(served.name, args.stores)
                console.say(f"{served.name!r} spread over {args.stores} stores on the Redis Cluster")
        else:
            data_dir = Path(tempfile.mkdtemp(prefix="ortfleet-up-"))
            _start_redis(fleet, console, signals, data_dir)
            if args.stores > 1:
                with signals.held():
                    stores = fleet.spread_model(served.name, args.stores, data_dir=data_dir)
                console.say(f"{served.name!r} spread over {len(stores)} stores: {', '.join(stores)}")
        redis_url = fleet.redis_url
        with signals.held():
            metrics_ports = _start_fleet(fleet, console, args, plan, served, port)
        base_url = _base_url(args.host, port)
        worker_metrics = [f"{_base_url(settings.metrics_host, p)}/metrics" for p in metrics_ports]
        if args.metrics_sd is not None:
            targets = [url.removeprefix("http://").removesuffix("/metrics") for url in worker_metrics]
            gateway_target = base_url.removeprefix("http://")
            write_file_sd(args.metrics_sd, file_sd_groups([gateway_target], targets))
        _await_workers(fleet, console, len(plan), served.name, args.startup_timeout)
        console.say(f"fleet ready in {console.elapsed()}")
        _print_ready(base_url, served, worker_metrics, redis_url, external_redis=data_dir is None)
        raise ChildExited(fleet.wait_for_exit())
    except FleetStopped as e:
        console.say(f"{signal.Signals(e.signum).name} received: stopping the fleet")
        return 0
    except ChildExited as e:
        _report_death(console, e)
        return 1
    except StartupError as e:
        console.say(f"ortfleet up: {e}")
        return 1
    finally:
        try:
            fleet.stop_all(say=console.say)
        finally:
            if data_dir is not None:
                shutil.rmtree(data_dir, ignore_errors=True)
            signals.restore()
        if fleet.processes:
            console.say("fleet stopped")


def _with_cluster_stores(model: str, stores: int) -> str:
    """ORTFLEET_REDIS_SHARDS as the environment gives it, `model` given `stores` stores on the cluster."""
    shards = json.loads(os.environ.get("ORTFLEET_REDIS_SHARDS") or "{}")
    return json.dumps({**shards, model: stores})


def _check_stores(args: argparse.Namespace, workers: int) -> None:
    if args.stores > workers:
        raise StartupError(f"--stores {args.stores} with {workers} worker(s): each store needs a worker")


def _load_settings(args: argparse.Namespace) -> WorkerSettings:
    """The workers' settings, once the gateway's are known to be valid too (ValidationError otherwise)."""
    GatewaySettings(host=args.host, port=args.port)  # the flags the gateway is given
    return WorkerSettings()


def _plan_workers(args: argparse.Namespace) -> list[PlannedWorker]:
    try:
        return plan_workers(
            workers=args.workers,
            gpus=args.gpus,
            device=args.device,
            probe=nvidia_smi_gpus,
            pick_port=free_port,
            environ=os.environ,
            per_gpu=args.workers_per_gpu,
        )
    except GpuPlanError as e:
        raise StartupError(str(e)) from e


DEFAULT_MODEL_SERVED_AS = "smollm2"  # the name the README's examples use


def _resolve_model(args: argparse.Namespace, cache_root: Path, console: Console) -> Served:
    if args.model is not None:
        model_dir: Path = args.model.expanduser().resolve()
        if not (model_dir / "genai_config.json").is_file():
            raise StartupError(f"{model_dir} is not an ORT-GenAI model folder (it has no genai_config.json)")
    else:
        from ortfleet.modelbuild.default import ensure_default_model

        console.say(f"default model: looking in {cache_root}, building it there if needed")
        try:
            device = "cuda" if args.gpus else "cpu"
            model_dir = ensure_default_model(cache_root, device=device, progress=True)
        except (RuntimeError, OSError) as e:
            raise StartupError(f"the default model could not be built: {e}") from e
    default_name = model_dir.name if args.model is not None else DEFAULT_MODEL_SERVED_AS
    served = Served(model_dir, args.name or default_name)
    console.say(f"model {served.name!r} from {model_dir}")
    return served


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            reason = e.strerror or str(e)
            raise StartupError(
                f"the gateway cannot listen on {host}:{port}: {reason}; pass another --port"
            ) from e


def _check_redis(url: str, allow_eviction: bool) -> bool:
    """Whether the Redis at `url`, checked, is a node of a Redis Cluster."""
    from common.redis_client import RedisRefused, RedisUnreachable, check_redis

    try:
        config = check_redis(url, timeout_s=5.0)
    except RedisRefused as e:
        raise StartupError(f"{e}; correct --redis-url: {URL_FORMAT}") from e
    except RedisUnreachable as e:
        raise StartupError(f"{e}; start it, or leave out --redis-url to have a redis-server started") from e
    if config.evicts and not allow_eviction:
        raise StartupError(config.eviction_refusal(mask_url(url)))
    return config.cluster


def _start_redis(fleet: LocalFleet, console: Console, signals: StopSignals, data_dir: Path) -> None:
    console.say("starting redis... ", end="")
    try:
        with signals.held():
            child = fleet.start_redis(data_dir=data_dir / "data")
    except StartupError as e:
        console.say("failed")
        redis = fleet.processes[-1].last_lines() if fleet.processes else []
        raise StartupError("\n  ".join([str(e), *redis])) from e
    console.say(f"ok ({fleet.redis_url}, pid {child.pid}, AOF in {data_dir / 'data'})")


def _start_fleet(
    fleet: LocalFleet,
    console: Console,
    args: argparse.Namespace,
    plan: list[PlannedWorker],
    served: Served,
    port: int,
) -> list[int]:
    """Starts the planned workers (each with a /metrics port of its own) and the gateway; the metrics
    ports."""
    extra = ["--max-batch-size", str(args.max_batch_size)] if args.max_batch_size else []
    adapters = [flag for adapter in args.lora for flag in ("--lora", adapter)]
    attach: dict[str, dict[str, str]] = {}
    for name, (device, frontends) in planned_cores(plan).items():
        socket_path = Path(tempfile.mkdtemp(prefix="ortfleet-core-")) / f"{name}.sock"
        core = fleet.start_core(
            socket_path, frontends, *extra, model=served.model_dir, device=device, label=f"core-{name}"
        )
        attach[name] = {"ORTFLEET_ENGINE_CORE": f"unix:{socket_path}"}
        console.say(f"engine core {name} starting (pid {core.pid}, device {device}, {frontends} workers)")
    for index, planned in enumerate(plan, 1):
        store = {"ORTFLEET_STORE": str((index - 1) % args.stores + 1)} if args.stores > 1 else {}
        child = fleet.start_worker(
            served.name,
            *extra,
            *adapters,
            "--metrics-port",
            str(planned.metrics_port),
            model=served.model_dir,
            device=planned.device,
            env={**planned.env, **attach.get(planned.core, {}), **store},
            wait=False,
            label=planned.name,
        )
        console.say(f"worker {index}/{len(plan)} starting (pid {child.pid}, device {planned.device})")
    for gateway in fleet.start_gateways(args.gateways, port=port, host=args.host):
        console.say(f"gateway starting on {_base_url(args.host, port)} (pid {gateway.pid})")
    return [planned.metrics_port for planned in plan]


def _await_workers(fleet: LocalFleet, console: Console, workers: int, model: str, timeout_s: float) -> None:
    started = time.monotonic()
    deadline = started + timeout_s
    next_note = started + 10.0
    live = 0
    while live < workers:
        exited = fleet.unexpected_exit()
        if exited is not None:
            raise ChildExited(exited)
        try:
            fleet.wait_workers(model, live + 1, timeout_s=0.5)
        except StartupError as e:
            now = time.monotonic()
            if now > deadline:
                raise StartupError(
                    f"{workers - live} of {workers} workers not live after {timeout_s:g} s"
                ) from e
            if now > next_note:
                console.say(f"waiting for workers: {live}/{workers} live ({console.elapsed()})")
                next_note = now + 10.0
            continue
        live += 1
        console.say(f"worker {live}/{workers} live ({console.elapsed()})")


def _base_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in _WILDCARD_HOSTS else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def curl_example(base_url: str, model: str) -> str:
    """Shell lines that submit a chat job and stream its events."""
    question = {"role": "user", "content": "What is the capital of France?"}
    body = json.dumps({"model": model, "messages": [question], "max_tokens": 64})
    extract = "python3 -c 'import json,sys; print(json.load(sys.stdin)[\"id\"])'"
    return (
        f"JOB=$(curl -s {base_url}/v1/jobs -H 'Content-Type: application/json' \\\n"
        f"  -d {shlex.quote(body)} | {extract})\n"
        f'curl -N "{base_url}/v1/jobs/$JOB/events"'
    )


def _print_ready(
    base_url: str, served: Served, worker_metrics: list[str], redis_url: str, external_redis: bool
) -> None:
    lines = [
        f"ortfleet is up: {len(worker_metrics)} worker(s) serving {served.name!r}",
        f"  gateway  {base_url}",
        f"  openapi  {base_url}/openapi.json",
        f"  ready    {base_url}/readyz",
        f"  metrics  {base_url}/metrics",
        *(f"           {url} (worker {index})" for index, url in enumerate(worker_metrics, 1)),
        f"  status   ortfleet status --redis-url {shlex.quote(mask_url(redis_url))}",
    ]
    if external_redis:
        lines.append(f"  redis    {mask_url(redis_url)}")
    lines += [
        "",
        "Submit a job and stream its tokens:",
        "",
        curl_example(base_url, served.name),
        "",
        "Press Ctrl-C to stop the fleet.",
    ]
    print("\n".join(lines), flush=True)


def _report_death(console: Console, error: ChildExited) -> None:
    child = error.child
    lines = [f"ortfleet up: {error}; stopping the fleet"]
    last = child.last_lines()
    if last:
        lines.append(f"last {len(last)} log lines of {child.name}:")
        lines += [f"  {line}" for line in last]
    console.say("\n".join(lines))
