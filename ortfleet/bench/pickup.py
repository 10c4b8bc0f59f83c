"""`ortfleet bench pickup`: how soon an idle worker starts a job after its submission."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common import aio
from ortfleet.bench.http import Connection
from ortfleet.bench.machine import describe
from ortfleet.bench.report import table
from ortfleet.bench.stats import summary
from ortfleet.fleet.launcher import throwaway_fleet

NAME = "bench-pickup"


def run(model: Path | None, fake_engine: str | None, jobs: int) -> dict[str, Any]:
    with throwaway_fleet() as fleet:
        _, url = fleet.start_gateway()
        extra = ["--fake-engine", fake_engine] if fake_engine else []
        fleet.start_worker(NAME, *extra, model=model, wait=False)
        fleet.wait_workers(NAME, 1)
        samples = aio.run(_measure(url, jobs))
    return {
        "bench": "pickup",
        "machine": describe(),
        "engine": f"fake {fake_engine}" if fake_engine else str(model),
        "jobs": jobs,
        "queue_wait_ms": summary(samples["queue_wait"]),
        "client_submit_to_running_ms": summary(samples["running_event"]),
    }


async def _measure(url: str, jobs: int) -> dict[str, list[float]]:
    """One job at a time: submit, read its stream until done; the worker is idle at each submission."""
    connection = Connection(url)
    samples: dict[str, list[float]] = {"queue_wait": [], "running_event": []}
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 1}
    try:
        await _one(connection, body)  # warm-up
        for _ in tqdm(range(jobs), desc="pickup", unit="job", file=sys.stderr, leave=False):
            await asyncio.sleep(0.02)  # the worker is back in its idle wait
            started = time.perf_counter()
            job_id, running_at = await _one(connection, body)
            view = await connection.json("GET", f"/v1/jobs/{job_id}")
            samples["queue_wait"].append(view["timings"]["queue_wait_s"])
            samples["running_event"].append(running_at - started)
    finally:
        await connection.close()
    return samples


async def _one(connection: Connection, body: dict[str, Any]) -> tuple[str, float]:
    job = await connection.json("POST", "/v1/jobs", body, expect=202)
    running_at = 0.0
    async for event in connection.events(job["links"]["events"]):
        if event.event == "status" and '"running"' in event.data and not running_at:
            running_at = event.received
        elif event.event == "error":
            raise RuntimeError(f"job {job['id']} failed: {event.data}")
    return job["id"], running_at


def text(figures: dict[str, Any]) -> str:
    rows = []
    for key, label in (
        ("queue_wait_ms", "submission -> job started on the worker (timings.queue_wait_s)"),
        ("client_submit_to_running_ms", "client: POST sent -> 'running' event received"),
    ):
        s = figures[key]
        rows.append([label, s["p50"], s["p95"], s["p99"], s["max"], s["n"]])
    return table(["pickup (ms)", "p50", "p95", "p99", "max", "n"], rows)
