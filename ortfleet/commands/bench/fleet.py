"""`ortfleet bench` and `ortfleet bench fleet`: what the fleet costs on top of its engine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ortfleet.bench.backends import FLEET_APIS
from ortfleet.commands.bench.arguments import finish, int_list, model_dir, positive, server_root

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers


FLEET_HELP = (
    "N concurrent streaming clients against the worker's engine in-process (direct) and against the "
    "whole fleet over HTTP/SSE, in one run, with the same prompts and a fixed generation length"
)


def add_modes(modes: Subparsers) -> None:
    fleet = modes.add_parser("fleet", help=FLEET_HELP, description=FLEET_HELP)
    fleet_options(fleet)
    fleet.set_defaults(func=run_fleet)


def fleet_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency",
        type=int_list,
        default=[1, 2, 4, 8, 16],
        help="concurrent streams to measure, comma-separated (default 1,2,4,8,16)",
    )
    parser.add_argument(
        "--requests",
        type=positive,
        help="requests per concurrency, per side and round (default 4x the concurrency, at least 8)",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive,
        default=64,
        help="tokens every request generates (min = max, end of sequence masked; default 64)",
    )
    parser.add_argument("--rounds", type=positive, default=1, help="repeat direct/fleet rounds (default 1)")
    parser.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the default model)")
    parser.add_argument("--url", help="benchmark a running gateway instead of starting a local fleet")
    parser.add_argument("--name", help="served model name at --url (default: its only model)")
    parser.add_argument(
        "--device",
        default="auto",
        help="the direct engine's and the local fleet's worker's device: auto, cpu, cuda or cuda:N "
        "(default auto, as a worker picks)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write a PNG: tokens/s and TTFT")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the engine's threads (the worker's and the direct run's) to cores of their own and "
        "the gateway, Redis, the worker's event loop and the client to the others (Linux)",
    )
    parser.add_argument(
        "--stream-interval",
        type=positive,
        metavar="N",
        help="the local fleet's worker streams a job's tokens N at a time (ORTFLEET_STREAM_INTERVAL; "
        "default: the environment's, else 1)",
    )
    parser.add_argument(
        "--api",
        choices=list(FLEET_APIS),
        default="jobs",
        help="how the fleet's clients ask: jobs (POST /v1/jobs, then its SSE stream), completions "
        "(POST /v1/completions with stream=true, OpenAI's chunks; the same prompts) or responses "
        "(POST /v1/responses with stream=true, greedy; the prompt as a chat message, which may end before "
        "--max-tokens, so not the direct run's work); default jobs",
    )
    parser.add_argument(
        "--engine-cores",
        type=positive,
        metavar="N",
        help="with --pin: cores for the engine, the last N this process may use (default: half)",
    )


def run_fleet(args: argparse.Namespace) -> int:
    from common.worker_settings import WorkerSettings
    from ortfleet.bench import overhead, report
    from ortfleet.bench.pinning import Pinning

    pinning = None
    if args.pin:
        if args.url:
            raise SystemExit("ortfleet bench: --pin pins a local fleet's processes; it cannot with --url")
        try:
            pinning = Pinning.split(args.engine_cores)
        except ValueError as e:
            raise SystemExit(f"ortfleet bench: {e}") from e
    elif args.engine_cores is not None:
        raise SystemExit("ortfleet bench: --engine-cores goes with --pin")
    stream_interval = args.stream_interval
    if args.url:
        if stream_interval is not None:
            raise SystemExit(
                "ortfleet bench: --stream-interval sets a local fleet's worker; a fleet at --url has its own"
            )
    elif stream_interval is None:  # the local worker's own, from the environment
        stream_interval = WorkerSettings().stream_interval
    options = overhead.OverheadOptions(
        model_dir=model_dir(args.model),
        concurrency=args.concurrency,
        requests=args.requests,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        url=server_root(args.url) if args.url else None,
        name=args.name,
        pinning=pinning,
        stream_interval=stream_interval,
        api=args.api,
        device=args.device,
    )
    figures = overhead.run(options)
    if args.plot is not None:
        report.plot_fleet(figures, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return finish(figures, report.fleet_table(figures), args.json)
