"""`ortfleet bench gateway` and `redis`: what one gateway and one Redis carry, without a model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ortfleet.commands.bench.arguments import finish, float_list, positive

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers


def add_modes(modes: Subparsers) -> None:
    gateway = modes.add_parser(
        "gateway",
        help="one gateway alone (no model): concurrent SSE streams, relay latency, submissions/s",
        description="Starts redis-server and one gateway. A synthetic publisher writes token entries to "
        "the streams of N open SSE connections at a set rate; the client measures publish -> receipt "
        "latency. Then submissions per second on POST /v1/jobs, and the gateway's memory per open stream.",
    )
    gateway.add_argument("--streams", type=positive, default=5000, help="open SSE streams (default 5000)")
    gateway.add_argument(
        "--rate", type=float, default=1.0, help="token events per second on each stream (default 1)"
    )
    gateway.add_argument("--duration", type=float, default=20.0, help="seconds of publishing (default 20)")
    gateway.add_argument(
        "--submissions", type=positive, default=5000, help="POST /v1/jobs requests (default 5000)"
    )
    gateway.add_argument(
        "--submit-concurrency", type=positive, default=32, help="connections submitting (default 32)"
    )
    gateway.add_argument(
        "--writer",
        choices=["step", "plain"],
        default="step",
        help="how the synthetic publisher writes: step, as workers do (the step-write script, whose "
        "notice carries the entries; default), or plain (XADD and a notice of the stream keys alone, "
        "which the relay answers with reads)",
    )
    gateway.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    gateway.set_defaults(func=run_gateway)

    redis = modes.add_parser(
        "redis",
        help="what one Redis primary costs per submission and per token, and how many tokens/s it relays",
        description="Starts redis-server, a gateway and a fake-engine worker. Costs: jobs of 1 and of "
        "--max-tokens tokens, read over SSE; Redis commands (INFO commandstats) and CPU (INFO cpu) per "
        "submission and per generated token. Ceiling: a synthetic publisher writes token entries to "
        "--streams open SSE streams at each of --rates, until relay p99 passes --p99-target.",
    )
    redis.add_argument("--jobs", type=positive, default=200, help="jobs per cost run (default 200)")
    redis.add_argument("--max-tokens", type=positive, default=64, help="tokens per long job (default 64)")
    redis.add_argument("--streams", type=positive, default=500, help="open SSE streams (default 500)")
    redis.add_argument(
        "--rates",
        type=float_list,
        default=[1.0, 2.0, 5.0, 10.0, 20.0, 40.0],
        help="token events per second per stream, one step each (default 1,2,5,10,20,40)",
    )
    redis.add_argument("--step", type=float, default=10.0, help="seconds of publishing per step (default 10)")
    redis.add_argument(
        "--p99-target", type=float, default=50.0, help="relay p99 to stay under, ms (default 50)"
    )
    redis.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    redis.set_defaults(func=run_redis)


def run_gateway(args: argparse.Namespace) -> int:
    from ortfleet.bench import capacity

    figures = capacity.run(
        capacity.CapacityOptions(
            streams=args.streams,
            rate=args.rate,
            duration_s=args.duration,
            submissions=args.submissions,
            submit_concurrency=args.submit_concurrency,
            writer=args.writer,
        )
    )
    return finish(figures, capacity.text(figures), args.json)


def run_redis(args: argparse.Namespace) -> int:
    from ortfleet.bench import redis_load

    options = redis_load.RedisLoadOptions(
        jobs=args.jobs,
        max_tokens=args.max_tokens,
        streams=args.streams,
        rates=args.rates,
        step_s=args.step,
        p99_target_ms=args.p99_target,
    )
    figures = redis_load.run(options)
    return finish(figures, redis_load.text(figures), args.json)
