"""An engine core's host time per row, and its frontend's, with nothing else running: the real engine-core
process (`python -m worker.core`) on the fake engine, flat out, and the real client (`EngineCoreClient`)
in this process taking every step's updates as a worker's job runs would, without Redis or a job runner.

`python -m ortfleet.bench.core_host [--rows 256,512] [--seconds 5] [--json FILE]` runs, for each row count,
ROWS requests that never end on a fake engine stepping as fast as it can, and reports: steps a second and
tokens a second; the core's CPU per row of a step (its engine's own Python per row, the fake engine's, is
in it: a real engine's step runs on the device); and the frontend's CPU per token (reading the socket,
decoding each step, one update per row into its request's queue).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from ortfleet.bench.machine import cpu_seconds, describe
from worker.core.client import EngineCoreClient, SpawnedCore
from worker.engine import EngineUpdate, GenerationRequest

FAKE_STEP_MS = 0.001  # the fake engine's pause a step: as good as none


async def measure(rows: int, seconds: float, warmup_s: float = 1.0) -> dict[str, Any]:
    client = EngineCoreClient(SpawnedCore(["--fake-engine", f"{FAKE_STEP_MS}:{rows}"], 60))
    counted = {"tokens": 0}

    def take(update: EngineUpdate) -> None:
        counted["tokens"] += len(update.token_ids)

    try:
        for stream in client.submit([GenerationRequest([97], max_new_tokens=10**9) for _ in range(rows)]):
            stream.updates.consume(take)
        await asyncio.sleep(warmup_s)
        core_before, ours_before = cpu_seconds(client.facts.core_pid), time.process_time()
        tokens_before, started = counted["tokens"], time.monotonic()
        await asyncio.sleep(seconds)
        elapsed = time.monotonic() - started
        tokens = counted["tokens"] - tokens_before
        core_cpu = cpu_seconds(client.facts.core_pid) - core_before
        ours_cpu = time.process_time() - ours_before
    finally:
        client.close()
    return {
        "rows": rows,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed),
        "steps_per_s": round(tokens / rows / elapsed, 1),
        "core_cpu_us_per_row": round(core_cpu / tokens * 1e6, 2) if tokens else None,
        "core_cpu_cores": round(core_cpu / elapsed, 2),
        "frontend_cpu_us_per_token": round(ours_cpu / tokens * 1e6, 2) if tokens else None,
        "frontend_cpu_cores": round(ours_cpu / elapsed, 2),
    }


def text(runs: list[dict[str, Any]]) -> str:
    lines = ["engine core on the fake engine, flat out; frontend: the real client, no Redis, no job runner"]
    for run in runs:
        lines.append(
            f"  rows {run['rows']:4}: {run['tokens_per_s']:,} tokens/s ({run['steps_per_s']} steps/s)  "
            f"core CPU {run['core_cpu_us_per_row']} µs a row ({run['core_cpu_cores']} core)  "
            f"frontend CPU {run['frontend_cpu_us_per_token']} µs a token ({run['frontend_cpu_cores']} core)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ortfleet.bench.core_host", description=__doc__)
    parser.add_argument("--rows", default="256,512", help="row counts, comma-separated (default 256,512)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured a row count (default 5)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    runs = [asyncio.run(measure(int(rows), args.seconds)) for rows in args.rows.split(",")]
    print(text(runs))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "machine": describe()}, indent=2))


if __name__ == "__main__":
    main()
