"""`python -m worker`: load one model on one device and serve its queue."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

from common import aio
from common.model_folder import default_model_dir, is_complete
from common.redis_client import connect
from common.registry import WorkerInfo
from common.settings import WorkerSettings
from worker.device import Device, DeviceError, parse_device
from worker.engine import Engine, Tokenizer

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
        "--metrics-port", type=int, help="port of /metrics, 0 picks a free one (ORTFLEET_METRICS_PORT)"
    )
    parser.add_argument(
        "--fake-engine",
        metavar="DELAY_MS:CAPACITY[:static]",
        help="development and benchmarks: no model, a fake engine that gives each of CAPACITY "
        "requests one token every DELAY_MS (continuous batching; with :static, batches run to their "
        "end as on the static scheduler); --model is ignored",
    )
    return parser


def build_settings(args: argparse.Namespace) -> WorkerSettings:
    overrides = {
        "model": args.model,
        "device": args.device,
        "name": args.name,
        "redis_url": args.redis_url,
        "max_batch_size": args.max_batch_size,
        "metrics_port": args.metrics_port,
    }
    return WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})


def resolve_model(settings: WorkerSettings) -> Path:
    if settings.model is not None:
        model = settings.model.expanduser().resolve()
    else:
        model = default_model_dir(settings.model_cache)
        if not is_complete(model):
            raise SystemExit(
                f"ortfleet-worker: the default model in {model} is missing or incomplete; "
                "build it with `ortfleet model default` or pass --model DIR"
            )
    if not (model / "genai_config.json").is_file():
        raise SystemExit(
            f"ortfleet-worker: {model} is not an ORT-GenAI model folder (no genai_config.json); "
            "build the default model with `ortfleet model default` or pass --model DIR"
        )
    return model


def load_engine(settings: WorkerSettings, fake_engine: str | None) -> tuple[Engine, Tokenizer, Device, str]:
    if fake_engine is not None:
        from worker.fake_engine import FakeEngine, fake_engine_is_static, parse_fake_engine

        try:
            delay_s, capacity = parse_fake_engine(fake_engine)
        except ValueError as e:
            raise SystemExit(f"ortfleet-worker: {e}") from e
        fake = FakeEngine(delay_s, capacity, continuous_batching=not fake_engine_is_static(fake_engine))
        return fake, fake.tokenizer, Device("cpu"), settings.name or "fake"

    import onnxruntime_genai as og

    from worker.ort_engine import OrtEngine

    model_dir = resolve_model(settings)
    try:
        device = parse_device(settings.device, og.is_cuda_available)
    except DeviceError as e:
        raise SystemExit(f"ortfleet-worker: {e}") from e
    logger.info("loading %s on %s", model_dir, device)
    engine = OrtEngine(model_dir, device, settings.max_batch_size, settings.step_delay_s)
    return engine, engine.tokenizer, device, settings.name or model_dir.name


async def serve(settings: WorkerSettings, fake_engine: str | None = None) -> None:
    from worker.metrics import start_metrics
    from worker.service import WorkerService
    from worker.tokenizer_service import serve_tokenizer

    started = time.monotonic()
    engine, tokenizer, device, name = load_engine(settings, fake_engine)
    redis = connect(settings.redis_url_for(name))  # its model's shard, if the model has one
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
    )
    service = WorkerService(settings, redis, engine, tokenizer, info)
    width = await service.warm_up()
    if 0 < width < engine.capacity:
        logger.warning(
            "the engine is configured for %d rows but generated only %d together; serving with %d slots",
            engine.capacity,
            width,
            width,
        )
        engine.capacity = info.capacity = width
    try:
        metrics = start_metrics(service, settings.metrics_host, settings.metrics_port)
    except OSError as e:
        where = f"{settings.metrics_host}:{settings.metrics_port}"
        raise SystemExit(f"ortfleet-worker: cannot serve /metrics on {where}: {e}") from e
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
    tokenizer_calls = asyncio.create_task(serve_tokenizer(redis, name, tokenizer), name="tokenizer-calls")
    try:
        await service.run()
    finally:
        tokenizer_calls.cancel()
        metrics.close()
        engine.close()
        await redis.aclose()
        logger.info("worker %s stopped", info.id)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = build_settings(args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    aio.run(serve(settings, args.fake_engine))
