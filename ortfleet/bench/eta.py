"""`ortfleet bench eta`: how close a queued job's `queue_eta_s` comes to when it starts.

A burst of jobs of mixed sizes is submitted at once to one worker; each job's view is read at once, and
the wait it predicted is compared with the wait it had (its start, from its record's queue wait).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from common import aio
from ortfleet.bench.http import Connection
from ortfleet.bench.machine import describe
from ortfleet.bench.report import table
from ortfleet.bench.stats import percentile
from ortfleet.fleet.launcher import throwaway_fleet

NAME = "bench-eta"
WORDS = "the fleet serves text from one endpoint and many workers pull jobs from the queue".split()


def run(model: Path | None, jobs: int, seed: int = 7) -> dict[str, Any]:
    with throwaway_fleet() as fleet:
        _, url = fleet.start_gateway()
        fleet.start_worker(NAME, model=model, wait=False)
        fleet.wait_workers(NAME, 1)
        rows = aio.run(_measure(url, jobs, random.Random(seed)))
    queued = [row for row in rows if row["eta_s"] is not None and row["waited_s"] > 0]
    ratios = [row["eta_s"] / row["waited_s"] for row in queued]
    errors = [row["eta_s"] - row["waited_s"] for row in queued]
    return {
        "bench": "eta",
        "machine": describe(),
        "engine": str(model),
        "jobs": jobs,
        "queued_when_read": len(queued),
        "eta_over_wait": {p: _round(percentile(ratios, p)) for p in (10, 50, 90)},
        "eta_minus_wait_s": {p: _round(percentile(errors, p)) for p in (10, 50, 90)},
        "mean_abs_error_s": _round(sum(abs(e) for e in errors) / len(errors)) if errors else None,
        "rows": rows,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _body(rng: random.Random) -> dict[str, Any]:
    """A job of one of several sizes, generating exactly its max_tokens (ignore_eos)."""
    words = rng.choice([8, 60, 300])
    return {
        "model": NAME,
        "prompt": " ".join(rng.choice(WORDS) for _ in range(words)),
        "max_tokens": rng.choice([16, 64, 128]),
        "ignore_eos": True,
    }


async def _measure(url: str, jobs: int, rng: random.Random) -> list[dict[str, Any]]:
    connection = Connection(url)
    try:
        warm = [await connection.json("POST", "/v1/jobs", _body(rng), expect=202) for _ in range(8)]
        for job in warm:  # the worker measures its speed while it runs these
            await _ended(connection, job["id"])
        await asyncio.sleep(3)  # a heartbeat publishes it
        bodies = [_body(rng) for _ in range(jobs)]
        submitted = [await connection.json("POST", "/v1/jobs", body, expect=202) for body in bodies]
        read = []
        for job in submitted:
            view = await connection.json("GET", f"/v1/jobs/{job['id']}")
            read.append((time.time(), view))
        rows = []
        for (read_at, view), body in zip(read, bodies, strict=True):
            done = await _ended(connection, view["id"])
            started_at = done["created_at"] + done["timings"]["queue_wait_s"]
            rows.append(
                {
                    "position": view.get("queue_position"),
                    "eta_s": view.get("queue_eta_s"),
                    "waited_s": round(started_at - read_at, 3),
                    "prompt_chars": len(body["prompt"]),
                    "max_tokens": body["max_tokens"],
                }
            )
        return rows
    finally:
        await connection.close()


async def _ended(connection: Connection, job_id: str) -> dict[str, Any]:
    while True:
        view: dict[str, Any] = await connection.json("GET", f"/v1/jobs/{job_id}?wait=60")
        if view["status"] in ("succeeded", "failed", "cancelled"):
            return view


def text(figures: dict[str, Any]) -> str:
    ratio, error = figures["eta_over_wait"], figures["eta_minus_wait_s"]
    rows = [
        ["eta / wait", ratio[10], ratio[50], ratio[90]],
        ["eta - wait (s)", error[10], error[50], error[90]],
    ]
    return (
        f"{figures['queued_when_read']} of {figures['jobs']} jobs queued when read; "
        f"mean |eta - wait| {figures['mean_abs_error_s']} s\n" + table(["", "p10", "p50", "p90"], rows)
    )
