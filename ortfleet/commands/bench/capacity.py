"""`ortfleet bench gateway`, `redis` and `tokens`: what gateways and Redis carry, without a model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ortfleet.commands.bench.arguments import finish, float_list, int_list, non_negative_list, positive

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

    tokens = modes.add_parser(
        "tokens",
        help="the token plane at a GPU's rates: Redis, gateway and worker CPU per token, relay latency",
        description="Starts redis-server, gateways and fake-engine workers that step --rows rows every "
        "--step-ms (64 every 5 ms: an H200 on the default model). Closed-loop clients keep --streams job "
        "streams open (submit, read the events over SSE, submit again). Per level: tokens/s received; "
        "Redis CPU and commands, gateway CPU and worker CPU per generated token; relay latency (an "
        "event's arrival less its stream entry's time); the gap between a stream's events; TTFT. Each "
        "--coalesce-ms value runs a fleet of its own (ORTFLEET_STREAM_COALESCE_MS; 0 is off), and so does "
        "each --stores value: the model's jobs spread over that many redis-servers (ORTFLEET_REDIS_SHARDS), "
        "the workers over the stores in turn; each store's Redis CPU is reported, and the tokens/s at "
        "which the busiest would fill its core.",
    )
    tokens.add_argument("--workers", type=positive, default=1, help="fake-engine workers (default 1)")
    tokens.add_argument("--rows", type=positive, default=64, help="each worker's rows (default 64)")
    tokens.add_argument("--step-ms", type=float, default=5.0, help="each worker's step time (default 5)")
    tokens.add_argument(
        "--streams", type=int_list, default=[1, 64], help="open job streams, one level each (default 1,64)"
    )
    tokens.add_argument("--max-tokens", type=positive, default=256, help="tokens per job (default 256)")
    tokens.add_argument("--seconds", type=float, default=15.0, help="measured per level (default 15)")
    tokens.add_argument("--warmup", type=float, default=3.0, help="seconds before each window (default 3)")
    tokens.add_argument("--gateways", type=positive, default=1, help="gateways on one port (default 1)")
    tokens.add_argument(
        "--client-processes", type=positive, default=2, help="processes the clients run in (default 2)"
    )
    tokens.add_argument(
        "--coalesce-ms",
        type=non_negative_list,
        default=[0.0, 50.0],
        help="ORTFLEET_STREAM_COALESCE_MS values, a fleet each (default 0,50: off, then the default)",
    )
    tokens.add_argument(
        "--writes-per-s",
        type=float,
        default=2000.0,
        help="ORTFLEET_STREAM_WRITES_PER_S for every fleet (default 2000, the setting's default)",
    )
    tokens.add_argument(
        "--stores",
        type=int_list,
        default=[1],
        help="Redis stores of the model, a fleet each (default 1; --workers at least the largest)",
    )
    tokens.add_argument(
        "--cluster",
        type=int,
        default=0,
        metavar="PRIMARIES",
        help="each fleet's Redis a Redis Cluster of PRIMARIES primaries (no replicas), the model's "
        "stores hash tags on it (default 0: standalone Redis servers)",
    )
    tokens.add_argument(
        "--engine-core",
        choices=["off", "process"],
        default="off",
        help="where each worker's fake engine runs: off (in the worker) or process (an engine core of its "
        "own, over the real crossing; its CPU is reported apart) (default off)",
    )
    tokens.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    tokens.set_defaults(func=run_tokens)


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


def run_tokens(args: argparse.Namespace) -> int:
    from ortfleet.bench import token_plane

    options = token_plane.TokenPlaneOptions(
        workers=args.workers,
        rows=args.rows,
        step_ms=args.step_ms,
        streams=args.streams,
        max_tokens=args.max_tokens,
        seconds=args.seconds,
        warmup_s=args.warmup,
        gateways=args.gateways,
        client_processes=args.client_processes,
        coalesce_ms=args.coalesce_ms,
        writes_per_s=args.writes_per_s,
        stores=args.stores,
        engine_core=args.engine_core,
        cluster=args.cluster,
    )
    if args.workers < max(args.stores):
        print(
            f"--workers {args.workers}: fewer than --stores {max(args.stores)}; each store needs one",
            file=sys.stderr,
        )
        return 2
    figures = token_plane.run(options)
    return finish(figures, token_plane.text(figures), args.json)
