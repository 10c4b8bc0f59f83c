"""`ortfleet drill`: fault drills on a throwaway local fleet (see ortfleet/drill)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("drill", help="fault drills on a throwaway local fleet")
    drills = parser.add_subparsers(title="drills", metavar="DRILL", required=True)

    kills = drills.add_parser(
        "kills", help="kill -9 a job's worker at random points, N times; measure the resume"
    )
    kills.add_argument("--kills", type=int, default=20, help="rounds (default 20)")
    kills.add_argument("--max-tokens", type=int, default=300, help="tokens per job (default 300)")
    kills.add_argument("--prompt", default="Once upon a time, in a quiet village,", help="the job's prompt")
    kills.add_argument("--heartbeat-ttl", type=float, default=5.0, help="workers' ORTFLEET_HEARTBEAT_TTL_S")
    kills.add_argument("--step-delay", type=float, default=0.01, help="workers' ORTFLEET_STEP_DELAY_S")
    _common(kills)
    kills.set_defaults(func=_run_kills)

    chaos = drills.add_parser(
        "chaos", help="N concurrent jobs while workers and gateways are killed and Redis restarts"
    )
    chaos.add_argument("--jobs", type=int, default=30, help="concurrent jobs (default 30)")
    chaos.add_argument("--max-tokens", type=int, default=96, help="tokens per job (default 96)")
    chaos.add_argument("--prompts", type=int, default=6, help="distinct chat prompts, at most 6 (default 6)")
    chaos.add_argument("--workers", type=int, default=3, help="workers (default 3)")
    chaos.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="workers' engine batch rows (default 1: on CPU a batch's composition can change greedy text, "
        "so only batches of one compare texts with the fault-free run exactly)",
    )
    chaos.add_argument("--gateways", type=int, default=2, help="gateways (default 2)")
    chaos.add_argument("--worker-kills", type=int, default=6, help="kill -9 of a worker (default 6)")
    chaos.add_argument("--gateway-kills", type=int, default=2, help="kill -9 of a gateway (default 2)")
    chaos.add_argument("--redis-restarts", type=int, default=1, help="Redis restarts (default 1)")
    chaos.add_argument("--duration", type=float, default=35.0, help="seconds the faults are spread over")
    chaos.add_argument("--timeout", type=float, default=300.0, help="longest wait for a job's stream")
    chaos.add_argument("--heartbeat-ttl", type=float, default=2.0, help="workers' ORTFLEET_HEARTBEAT_TTL_S")
    chaos.add_argument("--step-delay", type=float, default=0.0, help="workers' ORTFLEET_STEP_DELAY_S")
    _common(chaos)
    chaos.set_defaults(func=_run_chaos)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="model folder (default: the default model, built once)")
    parser.add_argument(
        "--resume-mode", choices=["replay", "prefill"], default="replay", help="ORTFLEET_RESUME_MODE"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the random kill points and schedule")
    parser.add_argument("--json", type=Path, help="write every figure to this file")


def _run_kills(args: argparse.Namespace) -> int:
    from ortfleet.drill.kills import run_kills

    return run_kills(args)


def _run_chaos(args: argparse.Namespace) -> int:
    from ortfleet.drill.chaos import run_chaos

    return run_chaos(args)
