"""`python -m worker.core`: an engine-core process. With `--fd N` it serves the worker that started it
on the socket it inherited; with `--socket PATH`, up to `--frontends` workers that connect there
(ORTFLEET_ENGINE_CORE=unix:PATH), each with its share of the engine's rows."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path

from common import aio
from common.model_folder import served_fingerprint
from common.startup import CannotStart, debug_wanted, exit_with, log_to_stderr, settings_or_exit
from common.worker_settings import WorkerSettings

PROG = "ortfleet-engine-core"
FLAGS = {
    "model": "--model",
    "device": "--device",
    "max_batch_size": "--max-batch-size",
    "scheduler": "--scheduler",
    "lora_modules": "--lora",
}

logger = logging.getLogger("worker.core")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="the inherited socket of the one worker this core serves")
    where.add_argument("--socket", type=Path, help="a Unix socket path where workers connect")
    parser.add_argument(
        "--frontends", type=int, default=1, help="with --socket: workers served at once, each with its share"
    )
    parser.add_argument("--model", type=Path, help="ORT-GenAI model folder (ORTFLEET_MODEL)")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N (ORTFLEET_DEVICE)")
    parser.add_argument("--max-batch-size", type=int, help="engine batch rows (ORTFLEET_MAX_BATCH_SIZE)")
    parser.add_argument(
        "--scheduler", choices=["auto", "batcher", "og-engine", "paged"], help="ORTFLEET_SCHEDULER"
    )
    parser.add_argument(
        "--lora", dest="lora_modules", action="append", metavar="NAME=PATH", help="as the worker's"
    )
    parser.add_argument("--fake-engine", metavar="DELAY_MS:CAPACITY[:static]", help="as the worker's")
    return parser


async def run_core(args: argparse.Namespace, settings: WorkerSettings) -> int:
    from worker.core.server import EngineCore, serve_path, serve_socket
    from worker.engines.device import Device
    from worker.engines.engine_choice import engine_kind
    from worker.engines.engine_loading import (
        chosen_device,
        freeze_loaded_objects,
        local_engine,
        resolve_model,
    )

    if args.frontends < 1:
        raise CannotStart(f"--frontends must be at least 1, not {args.frontends}")
    settings = settings.model_copy(update={"engine_core": "off"})  # the engine runs here
    if args.fake_engine is not None:
        model_dir = None
    elif args.fd is not None and settings.model is not None:  # its worker has checked the folder
        model_dir = settings.model
    else:
        model_dir = resolve_model(settings)
    device = Device("cpu") if model_dir is None else chosen_device(settings)
    engine, _ = local_engine(settings, model_dir, args.fake_engine, device)
    kind = "fake" if model_dir is None else engine_kind(settings.scheduler, model_dir, device)
    core = EngineCore(
        engine,
        asyncio.get_running_loop(),
        frontends=args.frontends,
        device=str(device),
        kind=kind,
        model_dir=str(model_dir or ""),
        fingerprint=served_fingerprint(model_dir),
        stall_limit_s=settings.engine_core_stall_s,
    )
    freeze_loaded_objects()
    if args.fd is not None:
        return await serve_socket(core, socket.socket(fileno=args.fd))
    return await serve_path(core, args.socket)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = settings_or_exit(PROG, WorkerSettings, args, FLAGS)
    log_to_stderr(settings)
    if args.fd is not None:  # its worker decides when it stops: the crossing closing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        status = aio.run(run_core(args, settings))
    except CannotStart as e:
        exit_with(PROG, [str(e)], e, debug=debug_wanted(settings))
    sys.exit(status)


if __name__ == "__main__":
    main()
