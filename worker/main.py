"""`python -m worker`: load one model on one device and serve its queue."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from common import aio
from common.adapter_calls import runtime_adapters
from common.model_folder import (
    served_fingerprint,
)
from common.redis_client import RedisRefused, RedisUnreachable, check_redis, connect_store
from common.redis_url import URL_FORMAT, mask_url
from common.registry import WorkerInfo, live_workers, start_adapters, worker_adapters
from common.startup import (
    CannotStart,
    check_store_config,
    debug_wanted,
    exit_with,
    log_to_stderr,
    settings_or_exit,
    store_label,
)
from common.store_config import StoreConfig
from common.store_watch import StoreWatch, quiet_out_of_memory_lines
from common.stores import Store
from common.worker_settings import WorkerSettings
from worker.engine import Engine, Tokenizer
from worker.engines.device import Device, parse_device
from worker.engines.engine_choice import adapters_refusal
from worker.engines.engine_loading import (
    REBUILD,
    chosen_device,
    freeze_loaded_objects,
    local_engine,
    resolve_model,
)
from worker.service import EngineUnrecoverable, WarmUpFailed, WorkerService

if TYPE_CHECKING:
    from worker.core.client import EngineCoreClient
    from worker.metrics import MetricsServer

PROG = "ortfleet-worker"
FLAGS = {
    "model": "--model",
    "device": "--device",
    "name": "--name",
    "redis_url": "--redis-url",
    "max_batch_size": "--max-batch-size",
    "scheduler": "--scheduler",
    "metrics_port": "--metrics-port",
    "store": "--store",
    "lora_modules": "--lora",
}
REDIS_CHECK_TIMEOUT_S = 5.0

logger = logging.getLogger("worker")


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line; each flag but --fake-engine overrides the setting of the same name."""
    parser = argparse.ArgumentParser(prog="ortfleet-worker", description=__doc__)
    parser.add_argument("--model", type=Path, help="ORT-GenAI model folder (ORTFLEET_MODEL)")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N (ORTFLEET_DEVICE, default auto)")
    parser.add_argument("--name", help="served model name (ORTFLEET_NAME, default: the folder's name)")
    parser.add_argument("--redis-url", help="Redis URL (ORTFLEET_REDIS_URL)")
    parser.add_argument("--max-batch-size", type=int, help="engine batch rows (ORTFLEET_MAX_BATCH_SIZE)")
    parser.add_argument(
        "--scheduler",
        choices=["auto", "batcher", "og-engine", "paged"],
        help="what batches the requests (ORTFLEET_SCHEDULER, default auto)",
    )
    parser.add_argument(
        "--metrics-port", type=int, help="port of /metrics, 0 picks a free one (ORTFLEET_METRICS_PORT)"
    )
    parser.add_argument(
        "--store",
        type=int,
        help="which of the model's Redis stores to serve, 1 the first (ORTFLEET_STORE, default 0: "
        "the one with the fewest workers of the model among those that answer)",
    )
    parser.add_argument(
        "--lora",
        dest="lora_modules",
        action="append",
        metavar="NAME=PATH",
        help="serve the LoRA adapter in PATH (a PEFT folder) to requests whose model is NAME; once per "
        "adapter (ORTFLEET_LORA_MODULES, a JSON map)",
    )
    parser.add_argument(
        "--fake-engine",
        metavar="DELAY_MS:CAPACITY[:static]",
        help="development and benchmarks: no model, a fake engine that gives each of CAPACITY "
        "requests one token every DELAY_MS (continuous batching; with :static, batches run to their "
        "end as on the static scheduler); stop strings end a request and are cut from its text as on "
        "a model; --model is ignored",
    )
    return parser


async def check_one_model_per_name(
    settings: WorkerSettings,
    name: str,
    model_dir: Path | None,
    cluster: bool = False,
    recorded: Collection[str] = (),
) -> str:
    """The model's fingerprint; CannotStart when a live worker serves another model under `name` (two
    models under one name would answer alike requests differently, and a job resumed on the other would
    feed it token ids of another vocabulary), or was given other LoRA adapters at start (a request naming
    one would fail on the workers without it; `recorded`: those of the settings' adapters loaded at run
    time, which every worker loads), or when an adapter's name is a served model's."""
    fingerprint = served_fingerprint(model_dir)
    adapters = sorted(adapter for adapter in settings.lora_modules if adapter not in recorded)
    if name in settings.lora_modules:
        raise CannotStart(f"the LoRA adapter {name!r} (--lora) has the served model's name; give it another")
    workers: list[dict[str, str]] = []
    # every store of the model: gateways place its jobs on any
    for store in settings.stores_for(name, cluster):
        redis = connect_store(store)
        try:
            workers += await live_workers(redis, store.keys)
        except RedisError:  # a store down now: its workers are checked against this one when it is back
            continue
        finally:
            await redis.aclose()
    for other in workers:
        theirs = other.get("fingerprint", "")
        where = f"{other.get('host', '?')}:{other.get('model_dir') or '?'}"
        if other.get("model") in settings.lora_modules:
            raise CannotStart(
                f"the LoRA adapter {other.get('model')!r} (--lora) has the name of a model worker "
                f"{other.get('id')} serves from {where}; give the adapter another name"
            )
        if other.get("model") != name:
            shared = sorted(set(worker_adapters(other)) & set(adapters))
            if shared:
                raise CannotStart(
                    f"the LoRA adapter {shared[0]!r} (--lora) is served by worker {other.get('id')} as an "
                    f"adapter of model {other.get('model')!r}; an adapter's name names one model's adapter: "
                    "give it another"
                )
            continue
        if theirs and theirs != fingerprint:
            raise CannotStart(
                f"model name {name!r} is served by worker {other.get('id')} from {where} (model "
                f"fingerprint {theirs}), and {model_dir or 'this worker'} holds another model (fingerprint "
                f"{fingerprint}); serve it under another --name, or stop the workers of {name!r} first"
            )
        their_adapters = start_adapters(other)
        if their_adapters != adapters:
            raise CannotStart(
                f"model name {name!r} is served by worker {other.get('id')} from {where} with LoRA adapters "
                f"{their_adapters or 'none'}, and this worker would serve {adapters or 'none'}: every worker "
                f"of a name serves the same adapters; give this one the same --lora flags, or stop the "
                f"workers of {name!r} first"
            )
    return fingerprint


async def with_recorded_adapters(
    settings: WorkerSettings, store: Store, name: str, refusal: str | None
) -> tuple[WorkerSettings, dict[str, str]]:
    """The settings with the model's adapters loaded at run time (its record) among its LoRA adapters, and
    those; CannotStart when the worker's engine serves none (`refusal`) or --lora names one of them."""
    redis = connect_store(store)
    try:
        recorded = await runtime_adapters(redis, store.keys, name)
    finally:
        await redis.aclose()
    if not recorded:
        return settings, recorded
    names = ", ".join(sorted(recorded))
    if refusal is not None:
        raise CannotStart(
            f"{refusal}, and model {name!r} has LoRA adapters loaded at run time ({names}): unload them "
            "(POST /v1/unload_lora_adapter) or run the batcher or the paged engine"
        )
    given = sorted(set(recorded) & set(settings.lora_modules))
    if given:
        raise CannotStart(
            f"the LoRA adapter {given[0]!r} (--lora) is loaded into model {name!r} at run time already; "
            "leave it out of --lora (the worker loads it from the record), or unload it first"
        )
    adapters = {**settings.lora_modules, **{adapter: Path(path) for adapter, path in recorded.items()}}
    return settings.model_copy(update={"lora_modules": adapters}), recorded


def runtime_refusal(
    settings: WorkerSettings, model_dir: Path | None, device: Device, fake: bool
) -> str | None:
    """Why this worker cannot load LoRA adapters at run time (None: it can): its engine serves none, or
    runs in an engine core."""
    refusal = adapters_refusal(settings, model_dir, device, fake)
    if refusal is None and settings.engine_core_mode(device.kind) != "off":
        return (
            "LoRA adapters are loaded at run time only into an engine in the worker's own process "
            "(ORTFLEET_ENGINE_CORE=off)"
        )
    return refusal


def served_name(settings: WorkerSettings, model_dir: Path | None) -> str:
    return settings.name or (model_dir.name if model_dir is not None else "fake")


def load_engine(
    settings: WorkerSettings, model_dir: Path | None, fake_engine: str | None
) -> tuple[Engine, Tokenizer, Device]:
    """The worker's engine, its tokenizer and its device: the engine in this process, or a client of an
    engine core (ORTFLEET_ENGINE_CORE)."""
    device = Device("cpu") if fake_engine is not None else chosen_device(settings)
    mode = settings.engine_core_mode(device.kind)
    if mode.startswith("unix:") and settings.lora_modules:
        raise CannotStart(
            "a shared engine core (ORTFLEET_ENGINE_CORE=unix:PATH) does not serve LoRA adapters yet; leave "
            "out --lora, or run the worker's engine in-process (ORTFLEET_ENGINE_CORE=off) or in its own core"
        )
    if mode != "off":
        client = engine_core_client(settings, model_dir, fake_engine, mode)
        if mode.startswith("unix:"):  # the shared core chose its device, and must hold this model
            check_same_model(client, model_dir, mode.removeprefix("unix:"))
            device = parse_device(client.facts.device, lambda: True)
        return client, frontend_tokenizer(model_dir), device
    return (*local_engine(settings, model_dir, fake_engine, device), device)


def engine_core_client(
    settings: WorkerSettings, model_dir: Path | None, fake_engine: str | None, mode: str
) -> EngineCoreClient:
    """A client of the worker's own engine core (`process`), which it starts with the settings it holds,
    or of a shared one at a socket path (`unix:PATH`)."""
    from worker.core.client import EngineCoreClient, SharedCore, SpawnedCore

    launcher: SharedCore | SpawnedCore
    if mode == "process":
        args = ["--fake-engine", fake_engine] if fake_engine is not None else ["--model", str(model_dir)]
        args += ["--device", settings.device, "--scheduler", settings.scheduler]
        if settings.max_batch_size is not None:
            args += ["--max-batch-size", str(settings.max_batch_size)]
        for adapter, path in settings.lora_modules.items():
            args += ["--lora", f"{adapter}={path}"]
        launcher = SpawnedCore(args, settings.engine_core_wait_s)
        logger.info("starting the engine core for %s", model_dir or f"a fake engine ({fake_engine})")
    else:
        launcher = SharedCore(Path(mode.removeprefix("unix:")), settings.engine_core_wait_s)
    client = EngineCoreClient(launcher)
    facts = client.facts
    logger.info(
        "engine core pid %d: %s on %s, %d of its rows for this worker (%d frontend(s))",
        facts.core_pid,
        facts.engine,
        facts.device,
        facts.capacity,
        facts.frontends,
    )
    return client


def check_same_model(client: EngineCoreClient, model_dir: Path | None, path: str) -> None:
    """CannotStart when a shared engine core holds another model than the worker serves: the worker's
    tokenizer would turn the core's tokens into another model's text."""
    facts = client.facts
    ours = served_fingerprint(model_dir)
    if facts.fingerprint != ours:
        client.close()
        theirs = facts.model_dir or "a fake engine"
        raise CannotStart(
            f"the engine core at {path} (pid {facts.core_pid}) runs {theirs} (model fingerprint "
            f"{facts.fingerprint}), and this worker serves {model_dir or 'a fake engine'} (fingerprint "
            f"{ours}); give the worker the core's --model, or attach it to a core of its own model"
        )


def engine_core_label(mode: str) -> str:
    """Where the worker's engine runs, as its registry entry says: in-process, own or shared."""
    return {"off": "in-process", "process": "own"}.get(mode, "shared")


def frontend_tokenizer(model_dir: Path | None) -> Tokenizer:
    """The model's tokenizer without its weights, for a worker whose engine runs in an engine core."""
    if model_dir is None:
        from worker.engines.fake_engine import FakeTokenizer

        return FakeTokenizer()
    import onnxruntime_genai as og

    from worker.engines.genai_config import vocab_size
    from worker.engines.ort_tokenizer import OrtTokenizer

    return OrtTokenizer(og.Config(str(model_dir)), vocab_size(model_dir), model_dir)


def job_kv_budget(engine: Engine) -> int:
    """The KV tokens (prompt and max_tokens) one job may need on this engine; 0 when every job that fits
    the model's context fits (og.Engine, or a budget of at least the context)."""
    budget = int(getattr(engine, "kv_budget_tokens", 0))  # ortfleet's batcher's (ORTFLEET_KV_BUDGET_TOKENS)
    return budget if 0 < budget < engine.context_length else 0


class StoreDown(CannotStart):
    """A store's Redis did not answer: an outage (choosing a store passes over it), not a mistake."""


def check_redis_url(
    url: str, setting: str, settings: WorkerSettings, store: str = "", *, allow_cluster: bool = False
) -> StoreConfig:
    """What the Redis at `url` is; CannotStart when it is unreachable (StoreDown), refuses its URL (a worker
    without its Redis has nothing to do), is a cluster node where a whole server is wanted (unless
    `allow_cluster`) or evicts keys (unless allowed); `store` (store_label), where the model has several,
    begins the message."""
    named = f"{store}: " if store else ""
    try:
        config = check_redis(url, REDIS_CHECK_TIMEOUT_S, allow_cluster=allow_cluster)
    except RedisRefused as e:
        raise CannotStart(f"{named}{e}; correct the URL in {setting}: {URL_FORMAT}") from e
    except RedisUnreachable as e:
        raise StoreDown(f"{named}{e}; start it, or set {setting} (or --redis-url) to one that runs") from e
    try:
        check_store_config(config, mask_url(url), settings.allow_evicting_redis)
    except CannotStart as e:
        raise CannotStart(f"{named}{e}") from e
    return config


def model_stores(settings: WorkerSettings, name: str) -> list[Store]:
    """The model's stores, ORTFLEET_REDIS_URL asked whether it is a Redis Cluster where that matters (a
    model without stores of its own, or with stores on the cluster); CannotStart when it cannot be, or is
    not the cluster the map wants."""
    given = settings.redis_shards.get(name)
    if given is not None and not isinstance(given, int):
        return settings.stores_for(name)
    config = check_redis_url(
        settings.redis_url.get_secret_value(), "ORTFLEET_REDIS_URL", settings, allow_cluster=True
    )
    if given is not None and not config.cluster:
        raise CannotStart(
            f"ORTFLEET_REDIS_SHARDS gives model {name!r} {given} stores on a Redis Cluster, but the Redis at "
            f"{mask_url(settings.redis_url.get_secret_value())} (ORTFLEET_REDIS_URL) is not a cluster node: "
            "give the cluster as ORTFLEET_REDIS_URL, or list the model's Redis servers by URL"
        )
    return settings.stores_for(name, config.cluster)


async def chosen_store(settings: WorkerSettings, name: str) -> Store:
    """The store the worker serves: the model's one, the one ORTFLEET_STORE names, or the one with the
    fewest live workers of the model. Every store listed by URL is checked first: one that refuses its URL
    (a Redis Cluster node, a wrong password) or evicts keys is a mistake in the map that stops the worker,
    as it does where the model has one store; one that does not answer is passed over with a warning."""
    stores = model_stores(settings, name)
    by_url = name in settings.redis_shards and not stores[0].cluster
    setting = f"ORTFLEET_REDIS_SHARDS[{name}]" if name in settings.redis_shards else "ORTFLEET_REDIS_URL"
    if settings.store > len(stores):
        raise CannotStart(
            f"ORTFLEET_STORE (--store) is {settings.store}, but model {name!r} has {len(stores)} store(s) "
            f"({setting}); give 1 to {len(stores)}, or 0 for the one with the fewest workers"
        )
    if len(stores) == 1:
        if by_url:
            check_redis_url(stores[0].url, setting, settings)
        return stores[0]
    if settings.store:
        i = settings.store - 1
        if by_url:
            check_redis_url(stores[i].url, f"{setting}[{i}]", settings, store_label(name, i, len(stores)))
        return stores[i]
    usable: dict[Store, int] = {}
    down: list[StoreDown] = []
    for i, store in enumerate(stores):
        try:
            if by_url:
                check_redis_url(store.url, f"{setting}[{i}]", settings, store_label(name, i, len(stores)))
            usable[store] = await _workers_of_model(store, name)
        except StoreDown as e:
            logger.warning("%s; choosing among the other stores", e)
            down.append(e)
        except RedisError as e:  # a store on a cluster whose node does not answer now
            logger.warning("%s: %s; choosing among the other stores", store_label(name, i, len(stores)), e)
            down.append(StoreDown(f"{store_label(name, i, len(stores))}: {e}"))
    if not usable:
        raise down[0]
    fewest = min(usable.values())
    store = secrets.choice([store for store, count in usable.items() if count == fewest])
    logger.info("serving store %d of %d for %r (%s)", stores.index(store) + 1, len(stores), name, store.label)
    return store


async def _workers_of_model(store: Store, name: str) -> int:
    redis = connect_store(store)
    try:
        return sum(worker["model"] == name for worker in await live_workers(redis, store.keys))
    finally:
        await redis.aclose()


def open_metrics_port(settings: WorkerSettings) -> MetricsServer:
    from worker.metrics import open_metrics

    try:
        return open_metrics(settings.metrics_host, settings.metrics_port)
    except OSError as e:
        where = f"{settings.metrics_host}:{settings.metrics_port}"
        raise CannotStart(
            f"cannot serve /metrics on {where}: {e.strerror or e}; stop what holds the port or give "
            "another (--metrics-port, ORTFLEET_METRICS_PORT; 0 picks a free one)"
        ) from e


async def warmed_up(service: WorkerService, model_dir: Path | None) -> int:
    """The rows the engine generated together in its warm-up; CannotStart when the warm-up gave no text."""
    try:
        return await service.warm_up()
    except WarmUpFailed as e:
        raise CannotStart(f"the model in {model_dir}: {e}; its weights may be corrupt; {REBUILD}") from e


async def serve(settings: WorkerSettings, fake_engine: str | None = None) -> None:
    from worker.adapter_service import AdapterService
    from worker.tokenizer_service import serve_tokenizer

    started = time.monotonic()
    model_dir = resolve_model(settings) if fake_engine is None else None
    name = served_name(settings, model_dir)
    store = await chosen_store(settings, name)
    start_device = Device("cpu") if fake_engine is not None else chosen_device(settings)
    refusal = runtime_refusal(settings, model_dir, start_device, fake_engine is not None)
    settings, recorded = await with_recorded_adapters(settings, store, name, refusal)
    fingerprint = await check_one_model_per_name(settings, name, model_dir, store.cluster, recorded)
    metrics = open_metrics_port(settings)  # before the model loads: its port may be taken
    try:
        engine, tokenizer, device = load_engine(settings, model_dir, fake_engine)
    except BaseException:
        metrics.close()
        raise
    redis = connect_store(store)  # its model's store
    info = WorkerInfo(
        id=f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}",
        model=name,
        device=str(device),
        gpu=device.gpu_label,
        capacity=engine.capacity,
        context_length=engine.context_length,
        continuous_batching=engine.continuous_batching,
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=time.time(),
        kv_budget_tokens=job_kv_budget(engine),
        model_dir=str(model_dir or ""),
        fingerprint=fingerprint,
        engine_core=engine_core_label(settings.engine_core_mode(device.kind)),
        adapters={adapter: str(path) for adapter, path in settings.lora_modules.items()},
        runtime_adapters=sorted(recorded),
    )
    service = WorkerService(settings, redis, engine, tokenizer, info, store.keys)
    try:
        width = await warmed_up(service, model_dir)
        await check_one_model_per_name(
            settings, name, model_dir, store.cluster, recorded
        )  # one that started while this one loaded
    except BaseException:
        metrics.close()
        engine.close()
        await redis.aclose()
        raise
    if 0 < width < engine.capacity:
        logger.warning(
            "the engine is configured for %d rows but generated only %d together; serving with %d slots",
            engine.capacity,
            width,
            width,
        )
        engine.capacity = info.capacity = width
    watch = StoreWatch(redis, store.keys, store.label, settings.allow_evicting_redis, settings.job_ttl_s)
    metrics.observe(service, watch)
    freeze_loaded_objects()
    logger.info("metrics on %s", metrics.url)
    logger.info(
        "worker %s serves %r on %s: %d slots, %s batching, ready in %.1f s",
        info.id,
        name,
        device,
        engine.capacity,
        "continuous" if engine.continuous_batching else "static",
        time.monotonic() - started,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    tokenizer_calls = asyncio.create_task(
        serve_tokenizer(redis, store.keys, name, tokenizer), name="tokenizer-calls"
    )
    adapter_calls = asyncio.create_task(AdapterService(service, refusal).run(), name="adapter-calls")
    watching = asyncio.create_task(watch.run(), name="store-watch")
    try:
        await service.run()
    finally:
        watching.cancel()
        tokenizer_calls.cancel()
        adapter_calls.cancel()
        metrics.close()
        engine.close()
        await redis.aclose()
        logger.info("worker %s stopped", info.id)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = settings_or_exit(PROG, WorkerSettings, args, FLAGS)
    log_to_stderr(settings)
    quiet_out_of_memory_lines()
    try:
        aio.run(serve(settings, args.fake_engine))
    except CannotStart as e:
        exit_with(PROG, [str(e)], e, debug=debug_wanted(settings))
    except EngineUnrecoverable as e:  # its supervisor starts it again
        exit_with(PROG, [str(e)], e, debug=debug_wanted(settings))
