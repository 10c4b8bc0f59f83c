"""`ortfleet bench pickup`, `eta`, `sim` and `fairness`: how the queue hands jobs to workers."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ortfleet.commands.bench.arguments import finish, model_dir, positive

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers


def add_modes(modes: Subparsers) -> None:
    pickup = modes.add_parser(
        "pickup",
        help="time from submission to an idle worker starting the job",
        description="Sequential 1-token jobs on an idle worker: submission -> start on the worker "
        "(the job's timings.queue_wait_s) and submission -> the client receiving the 'running' event.",
    )
    pickup.add_argument("--jobs", type=positive, default=200, help="sequential jobs (default 200)")
    pickup.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the default model)")
    pickup.add_argument(
        "--fake-engine",
        metavar="DELAY_MS:CAPACITY",
        help="serve a fake engine instead of a model (e.g. 10:4)",
    )
    pickup.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    pickup.set_defaults(func=run_pickup)

    eta = modes.add_parser(
        "eta",
        help="how close a queued job's queue_eta_s comes to when it starts",
        description="A burst of jobs of mixed sizes (ignore_eos) on one worker: each job's queue_eta_s, read "
        "right after the burst, against the wait it had until it started.",
    )
    eta.add_argument("--jobs", type=positive, default=40, help="jobs in the burst (default 40)")
    eta.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the default model)")
    eta.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    eta.set_defaults(func=run_eta)

    sim = modes.add_parser(
        "sim",
        help="a simulated multi-GPU fleet: fake engines of different speeds behind the real gateway",
        description="Starts workers with fake engines (a per-token delay and a capacity each) behind the "
        "real gateway, queue and worker code, keeps the queue busy with fixed-length jobs, and reports "
        "each worker's share of tokens against its share of speed x capacity, queue waits, and the "
        "time any worker sat idle while jobs waited.",
    )
    sim.add_argument(
        "--workers",
        default="40:2,40:4,20:2,20:4,13.3:2,13.3:4,10:2,10:4",
        help="DELAY_MS:CAPACITY of each worker, comma-separated (default: 8 workers, 1x to 4x speed)",
    )
    sim.add_argument("--duration", type=float, default=30.0, help="seconds of load (default 30)")
    sim.add_argument("--max-tokens", type=positive, default=32, help="tokens per job (default 32)")
    sim.add_argument(
        "--clients",
        type=positive,
        help="concurrent clients (default: 1.5x the fleet's total capacity, so jobs always wait)",
    )
    sim.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    sim.set_defaults(func=run_sim)

    fairness = modes.add_parser(
        "fairness",
        help="priority classes and fair share between keys, on fake engines behind the real fleet",
        description="Scenario A: one key floods batch jobs while another sends an interactive job every "
        "interval; its queue wait and TTFT against an idle fleet, and every finished flood job checked "
        "exact. Scenario B: two saturating keys, weights 1:1 then 3:1; their token shares.",
    )
    fairness.add_argument(
        "--workers",
        default="20:4,20:4",
        help="DELAY_MS:CAPACITY[:static] of each worker (default 20:4,20:4)",
    )
    fairness.add_argument("--duration", type=float, default=20.0, help="seconds of each phase (default 20)")
    fairness.add_argument("--flood-jobs", type=positive, default=2000, help="batch jobs (default 2000)")
    fairness.add_argument("--flood-tokens", type=positive, default=64, help="tokens per batch job (64)")
    fairness.add_argument("--light-tokens", type=positive, default=16, help="tokens per interactive job (16)")
    fairness.add_argument(
        "--interval", type=float, default=0.5, help="seconds between interactive jobs (default 0.5)"
    )
    fairness.add_argument("--share-tokens", type=positive, default=32, help="tokens per job in B (32)")
    fairness.add_argument(
        "--no-preempt", action="store_true", help="workers do not preempt batch work (ORTFLEET_PREEMPT_BATCH)"
    )
    fairness.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    fairness.set_defaults(func=run_fairness)


def run_pickup(args: argparse.Namespace) -> int:
    from ortfleet.bench import pickup

    model = None if args.fake_engine else model_dir(args.model)
    figures = pickup.run(model, args.fake_engine, args.jobs)
    return finish(figures, pickup.text(figures), args.json)


def run_eta(args: argparse.Namespace) -> int:
    from ortfleet.bench import eta

    figures = eta.run(model_dir(args.model), args.jobs)
    return finish(figures, eta.text(figures), args.json)


def run_sim(args: argparse.Namespace) -> int:
    from ortfleet.bench import sim

    try:
        workers = sim.parse_workers(args.workers)
    except ValueError as e:
        raise SystemExit(f"ortfleet bench sim: {e}") from e
    figures = sim.run(sim.SimOptions(workers, args.duration, args.max_tokens, args.clients))
    return finish(figures, sim.text(figures), args.json)


def run_fairness(args: argparse.Namespace) -> int:
    from ortfleet.bench import fairness

    options = fairness.FairnessOptions(
        workers=[part.strip() for part in args.workers.split(",") if part.strip()],
        duration_s=args.duration,
        flood_jobs=args.flood_jobs,
        flood_tokens=args.flood_tokens,
        light_tokens=args.light_tokens,
        interval_s=args.interval,
        share_tokens=args.share_tokens,
        preempt=not args.no_preempt,
    )
    figures = fairness.run(options)
    return finish(figures, fairness.text(figures), args.json)
