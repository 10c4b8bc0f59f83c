"""A worker's host CPU per generated token at a card's rate, without a card: fake-engine workers, each the
frontend of an engine core (ORTFLEET_ENGINE_CORE=process, as on a GPU), take a burst of jobs submitted at
once while nobody reads their streams.

`python -m ortfleet.bench.worker_host [--rows 256] [--step-ms 4] [--jobs 1024] [--max-tokens 256]
[--frontends 1] [--json FILE]` queues JOBS jobs of MAX_TOKENS tokens through a gateway while the workers are
stopped (SIGSTOP), so that all of them wait when the workers go on (SIGCONT), and waits for them all to
end. It reports:

- tokens a second, from the workers going on to the last job's end, against what the fake engine offers
  (ROWS every STEP_MS ms);
- the CPU the worker's processes spent in that time, per generated token: each frontend, and the engine
  core (its own with `--frontends 1`; with more, one core serving them all, each with its share of ROWS);
- that every token arrived: each job succeeded with MAX_TOKENS tokens, and its stream holds them all, in
  order, once.

The gateway, Redis and this process (the submissions and the wait) are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import aio
from common.events import TOKEN, entry_token_ids
from common.keys import STANDALONE as keys  # benchmarks run on one Redis
from common.redis_client import connect
from ortfleet.bench.http import Connection
from ortfleet.bench.machine import child_pids, cpu_seconds, describe
from ortfleet.bench.report import write_json
from ortfleet.fleet.launcher import FleetProcess, throwaway_fleet

MODEL = "bench-worker-host"
SUBMITTERS = 16  # connections submitting the burst together


@dataclass(frozen=True)
class WorkerHostOptions:
    rows: int  # the engine's rows a step, all frontends together
    step_ms: float
    jobs: int
    max_tokens: int
    frontends: int  # 1: one worker with a core of its own; more: that many workers on one shared core
    engine_core: str = "process"  # or off: the fake engine in the worker's process


def run(options: WorkerHostOptions) -> dict[str, Any]:
    env = {
        "ORTFLEET_MAX_QUEUED_JOBS": "100000000",
        "ORTFLEET_MAX_QUEUED_TOKENS": "1000000000000",
        "ORTFLEET_ENGINE_CORE": options.engine_core,
        # The workers stay live while they are stopped for the submissions.
        "ORTFLEET_HEARTBEAT_TTL_S": "120",
    }
    spec = f"{options.step_ms:g}:{options.rows}"
    with throwaway_fleet(env) as fleet, tempfile.TemporaryDirectory(prefix="ortfleet-core-") as folder:
        _, url = fleet.start_gateway()
        core: FleetProcess | None = None
        if options.frontends > 1:
            path = Path(folder) / "core.sock"
            core = fleet.start_core(path, options.frontends, "--fake-engine", spec, device="cpu")
            shared = {"ORTFLEET_ENGINE_CORE": f"unix:{path}"}
            workers = [
                fleet.start_worker(MODEL, "--fake-engine", spec, env=shared, wait=False)
                for _ in range(options.frontends)
            ]
        else:
            workers = [fleet.start_worker(MODEL, "--fake-engine", spec, wait=False)]
        fleet.wait_workers(MODEL, len(workers))
        processes = {f"frontend {i + 1}": [worker.pid] for i, worker in enumerate(workers)}
        if core is not None:
            processes["core"] = [core.pid]
        elif options.engine_core == "process":
            processes["core"] = child_pids(workers[0].pid)
        figures = aio.run(_measure(options, url, fleet.redis_url, processes, workers))
    offered = options.rows / options.step_ms * 1000
    tokens = options.jobs * options.max_tokens
    cpu = figures.pop("cpu_s")
    return {
        "bench": "worker_host",
        "machine": describe(),
        "options": asdict(options),
        "offered_tokens_per_s": round(offered),
        "tokens_per_s": round(tokens / figures["seconds"]),
        "share_of_offered": round(tokens / figures["seconds"] / offered, 3),
        "cpu_us_per_token": {name: round(seconds / tokens * 1e6, 2) for name, seconds in cpu.items()},
        "cpu_us_per_token_all": round(sum(cpu.values()) / tokens * 1e6, 2),
        "cpu_cores": {name: round(seconds / figures["seconds"], 2) for name, seconds in cpu.items()},
        **figures,
    }


async def _measure(
    options: WorkerHostOptions,
    url: str,
    redis_url: str,
    processes: dict[str, list[int]],
    workers: list[FleetProcess],
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": options.max_tokens, "ignore_eos": True}
    connections = [Connection(url) for _ in range(SUBMITTERS)]
    try:
        await _submit(connections, body, 4)  # warm-up: the gateway's and the worker's first job paid
        await _ended(connections[0], (await _submit(connections, body, 1))[0])

        def cpu() -> dict[str, float]:
            return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in processes.items()}

        for worker in workers:
            worker.pause()
        try:
            ids = await _submit(connections, body, options.jobs)
        finally:
            before = cpu()
            started = time.time()
            for worker in workers:
                worker.resume()
        views = [await _ended(connections[0], job_id) for job_id in ids]
        after = cpu()
    finally:
        for connection in connections:
            await connection.close()
    ended = max(view["created_at"] + view["timings"]["total_s"] for view in views)
    running_s = sum(view["timings"]["total_s"] - view["timings"]["queue_wait_s"] for view in views)
    per_token = sorted(view["timings"]["time_per_output_token_s"] for view in views)
    return {
        "seconds": round(ended - started, 3),
        # how full the engine's rows were: the jobs' running time over rows x seconds
        "rows_busy": round(running_s / (options.rows * (ended - started)), 3),
        "step_ms_p50": round(per_token[len(per_token) // 2] * 1000, 2),
        "cpu_s": {name: after[name] - before[name] for name in processes},
        "delivered": await _delivered(redis_url, views, options.max_tokens),
    }


async def _submit(connections: list[Connection], body: dict[str, Any], jobs: int) -> list[str]:
    ids: list[str] = [""] * jobs

    async def submit(connection: Connection, first: int) -> None:
        for i in range(first, jobs, len(connections)):
            ids[i] = (await connection.json("POST", "/v1/jobs", body, expect=202))["id"]

    await asyncio.gather(*(submit(connection, i) for i, connection in enumerate(connections)))
    return ids


async def _ended(connection: Connection, job_id: str) -> dict[str, Any]:
    while True:
        view: dict[str, Any] = await connection.json("GET", f"/v1/jobs/{job_id}?wait=60")
        if view["status"] not in ("queued", "running"):
            return view


async def _delivered(redis_url: str, views: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """Whether every job succeeded with all its tokens, and its stream holds each of them once, in order."""
    redis = connect(redis_url)
    short = []
    try:
        for view in views:
            indexes: list[int] = []
            for _, fields in await redis.xrange(keys.events(view["id"])):
                if fields.get("type") == TOKEN:
                    first = int(fields["index"])
                    indexes += range(first, first + len(entry_token_ids(fields)))
            usage = view.get("usage") or {}
            if (
                view["status"] != "succeeded"
                or usage.get("completion_tokens") != max_tokens
                or indexes != list(range(max_tokens))
            ):
                short.append(view["id"])
    finally:
        await redis.aclose()
    return {"jobs": len(views), "complete": len(views) - len(short), "incomplete": short[:10]}


def text(figures: dict[str, Any]) -> str:
    options = figures["options"]
    per_token, cores = figures["cpu_us_per_token"], figures["cpu_cores"]
    each = ", ".join(f"{name} {us} µs ({cores[name]} core)" for name, us in per_token.items())
    delivered = figures["delivered"]
    return (
        f"{options['jobs']} jobs of {options['max_tokens']} tokens, {options['rows']} rows every "
        f"{options['step_ms']:g} ms, {options['frontends']} frontend(s), "
        f"engine core {options['engine_core']}\n"
        f"  {figures['tokens_per_s']:,} tokens/s of {figures['offered_tokens_per_s']:,} offered "
        f"({figures['share_of_offered']:.0%}) in {figures['seconds']} s; "
        f"jobs complete: {delivered['complete']} of {delivered['jobs']}\n"
        f"  rows busy {figures['rows_busy']:.0%}, a job's time per token p50 {figures['step_ms_p50']} ms\n"
        f"  CPU per token: {figures['cpu_us_per_token_all']} µs in all; {each}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ortfleet.bench.worker_host", description=__doc__)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--jobs", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--engine-core", choices=["process", "off"], default="process")
    parser.add_argument("--runs", type=int, default=1, help="runs, each on a fleet of its own")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    options = WorkerHostOptions(
        args.rows, args.step_ms, args.jobs, args.max_tokens, args.frontends, args.engine_core
    )
    runs = []
    for _ in range(args.runs):
        runs.append(run(options))
        print(text(runs[-1]), flush=True)
    if args.json is not None:
        write_json(args.json, runs[0] if len(runs) == 1 else {"runs": runs})
    return 0 if all(not r["delivered"]["incomplete"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
