"""`ortfleet bench sim`: a multi-GPU fleet simulated with fake engines behind the real gateway and queue.

Each worker process runs the real worker code on a fake engine with its own per-token delay and
capacity (continuous batching). Closed-loop clients keep more jobs in flight than the fleet has
slots, so jobs always wait. A pull-based fleet should then give every worker a share of the
generated tokens proportional to its speed x capacity, and no worker should sit idle while jobs
wait for longer than it takes to pick one up.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from common import aio
from common.jobs.record import JobRecord
from common.keys import STANDALONE as keys  # benchmarks run on one Redis
from common.redis_client import connect
from common.registry import live_workers
from common.wire import JobStatus
from ortfleet.bench.http import Connection
from ortfleet.bench.machine import describe
from ortfleet.bench.report import table
from ortfleet.bench.stats import summary
from ortfleet.fleet.launcher import throwaway_fleet

NAME = "bench-sim"
GOAL_SHARE_DEVIATION = 0.10


@dataclass(frozen=True)
class SimWorker:
    delay_ms: float
    capacity: int

    @property
    def tokens_per_s(self) -> float:
        """Tokens a second with every slot busy: speed x capacity."""
        return self.capacity * 1000 / self.delay_ms


@dataclass(frozen=True)
class SimOptions:
    workers: list[SimWorker]
    duration_s: float
    max_tokens: int
    clients: int | None = None


@dataclass(frozen=True)
class Job:
    worker: str
    created: float
    started: float
    first_token: float
    finished: float  # its last token: the engine slot is free from then on
    tokens: int
    queue_wait: float


def parse_workers(text: str) -> list[SimWorker]:
    workers = []
    for part in text.split(","):
        delay, sep, capacity = part.strip().partition(":")
        try:
            worker = SimWorker(float(delay), int(capacity))
        except ValueError as e:
            raise ValueError(f"--workers: {part!r} is not DELAY_MS:CAPACITY") from e
        if not sep or worker.delay_ms <= 0 or worker.capacity < 1:
            raise ValueError(f"--workers: {part!r} needs a positive delay and capacity")
        workers.append(worker)
    return workers


def run(options: SimOptions) -> dict[str, Any]:
    with throwaway_fleet({"ORTFLEET_MAX_QUEUED_JOBS": "1000000"}) as fleet:
        _, url = fleet.start_gateway()
        by_pid: dict[int, SimWorker] = {}
        for worker in options.workers:
            spec = f"{worker.delay_ms:g}:{worker.capacity}"
            by_pid[fleet.start_worker(NAME, "--fake-engine", spec, wait=False).pid] = worker
        fleet.wait_workers(NAME, len(options.workers), timeout_s=120)
        return aio.run(_simulate(options, url, fleet.redis_url, by_pid))


async def _simulate(
    options: SimOptions, url: str, redis_url: str, by_pid: dict[int, SimWorker]
) -> dict[str, Any]:
    redis = connect(redis_url)
    try:
        registry = {w["id"]: by_pid[int(w["pid"])] for w in await live_workers(redis, keys)}
        clients = options.clients or math.ceil(1.5 * sum(w.capacity for w in options.workers))
        began, stopped, job_ids = await _load(url, clients, options)
        jobs = await _read_jobs(redis, job_ids)
    finally:
        await redis.aclose()
    warm = min(2.0, options.duration_s / 10)
    return _figures(options, registry, jobs, began + warm, stopped, clients)


async def _load(url: str, clients: int, options: SimOptions) -> tuple[float, float, list[str]]:
    body = {"model": NAME, "prompt": "Hello", "max_tokens": options.max_tokens}
    body["min_tokens"] = options.max_tokens
    job_ids: list[str] = []
    began = time.time()
    deadline = began + options.duration_s

    async def client() -> None:
        connection = Connection(url)
        try:
            while time.time() < deadline:
                job = await connection.json("POST", "/v1/jobs", body, expect=202)
                job_ids.append(job["id"])
                await connection.json("GET", f"/v1/jobs/{job['id']}?wait=60")
        finally:
            await connection.close()

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    seconds = round(options.duration_s)
    with tqdm(total=seconds, desc="simulating", unit="s", file=sys.stderr, leave=False) as bar:
        while time.time() < deadline:
            await asyncio.sleep(1.0)
            bar.update()
    stopped = time.time()
    await asyncio.gather(*tasks)
    return began, stopped, job_ids


async def _read_jobs(redis: Any, job_ids: list[str]) -> list[Job]:
    async with redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        replies: list[dict[str, str]] = await pipe.execute()
    jobs = []
    for record in (JobRecord.from_fields(raw) for raw in replies if raw):
        if record.status is not JobStatus.succeeded:
            continue
        assert record.timings and record.usage and record.first_token_at and record.started_at
        assert record.worker and record.finished_at
        tokens = record.usage.completion_tokens
        first = record.first_token_at
        # The engine slot is busy until the last token (the worker frees it then, before the final write).
        last = first + (record.timings.time_per_output_token_s or 0.0) * (tokens - 1)
        jobs.append(
            Job(
                worker=record.worker,
                created=record.created_at,
                started=record.started_at,
                first_token=first,
                finished=min(last, record.finished_at),
                tokens=tokens,
                queue_wait=record.timings.queue_wait_s or 0.0,
            )
        )
    return jobs


def _overlap(start: float, end: float, low: float, high: float) -> float:
    return max(0.0, min(end, high) - max(start, low))


def _figures(
    options: SimOptions,
    registry: dict[str, SimWorker],
    jobs: list[Job],
    low: float,
    high: float,
    clients: int,
) -> dict[str, Any]:
    tokens = dict.fromkeys(registry, 0.0)
    for job in jobs:
        span = job.finished - job.first_token
        if job.worker in tokens:
            share = _overlap(job.first_token, job.finished, low, high) / span if span > 0 else 0.0
            tokens[job.worker] += job.tokens * share
    idle = idle_while_waiting(registry, jobs, low, high)
    total_tokens = sum(tokens.values()) or 1.0
    total_weight = sum(w.tokens_per_s for w in registry.values())
    window = high - low
    workers: list[dict[str, Any]] = []
    ratios: list[float] = []
    for worker_id, worker in sorted(registry.items(), key=lambda kv: (kv[1].tokens_per_s, kv[0])):
        share = tokens[worker_id] / total_tokens
        expected = worker.tokens_per_s / total_weight
        gaps = idle[worker_id]
        ratios.append(share / expected)
        workers.append(
            {
                "worker": worker_id,
                "delay_ms": worker.delay_ms,
                "capacity": worker.capacity,
                "nominal_tokens_per_s": round(worker.tokens_per_s, 1),
                "tokens_per_s": round(tokens[worker_id] / window, 1),
                "token_share": round(share, 4),
                "expected_share": round(expected, 4),
                "share_vs_expected": round(share / expected, 3),
                "idle_while_jobs_waited_ms": round(sum(gaps) * 1000, 1),
                "idle_gaps": len(gaps),
                "longest_idle_gap_ms": round(max(gaps, default=0.0) * 1000, 2),
            }
        )
    in_window = [job for job in jobs if low <= job.created <= high]
    all_gaps = [gap for gaps in idle.values() for gap in gaps]
    worst = max((abs(r - 1) for r in ratios), default=None)
    return {
        "bench": "sim",
        "machine": describe(),
        "workers": workers,
        "clients": clients,
        "max_tokens": options.max_tokens,
        "window_s": round(window, 2),
        "jobs": len(in_window),
        "tokens_per_s": round(sum(tokens.values()) / window, 1),
        "nominal_tokens_per_s": round(total_weight, 1),
        "worst_share_deviation": round(worst, 4) if worst is not None else None,
        "share_goal_met": worst is not None and worst <= GOAL_SHARE_DEVIATION,
        "queue_wait_ms": summary([job.queue_wait for job in in_window]),
        "idle_gap_ms": summary(all_gaps),
    }


def idle_while_waiting(
    registry: dict[str, SimWorker], jobs: list[Job], low: float, high: float
) -> dict[str, list[float]]:
    """Per worker, the stretches of time when it had a free slot while some job waited in the queue."""
    changes: list[tuple[float, str | None, int]] = []  # (time, worker or None for the queue, +1/-1)
    for job in jobs:
        changes += [(job.created, None, 1), (job.started, None, -1)]
        if job.worker in registry:
            changes += [(job.started, job.worker, 1), (job.finished, job.worker, -1)]
    changes.sort(key=lambda c: (c[0], c[2]))
    running = dict.fromkeys(registry, 0)
    waiting = 0
    gaps: dict[str, list[float]] = {w: [] for w in registry}
    open_since: dict[str, float | None] = dict.fromkeys(registry, None)
    for at, who, step in changes:
        if who is None:
            waiting += step
        else:
            running[who] += step
        for worker_id, worker in registry.items():
            idle = waiting > 0 and running[worker_id] < worker.capacity and low <= at <= high
            since = open_since[worker_id]
            if idle and since is None:
                open_since[worker_id] = at
            elif not idle and since is not None:
                gaps[worker_id].append(at - since)
                open_since[worker_id] = None
    return gaps


def text(figures: dict[str, Any]) -> str:
    headers = ["worker", "delay ms", "slots", "nominal tok/s", "tok/s", "share", "expected", "ratio"]
    headers += ["idle+waiting ms", "gaps", "longest ms"]
    rows = [
        [
            w["worker"][-14:],
            w["delay_ms"],
            w["capacity"],
            w["nominal_tokens_per_s"],
            w["tokens_per_s"],
            f"{w['token_share']:.1%}",
            f"{w['expected_share']:.1%}",
            f"{w['share_vs_expected']:.3f}",
            w["idle_while_jobs_waited_ms"],
            w["idle_gaps"],
            w["longest_idle_gap_ms"],
        ]
        for w in figures["workers"]
    ]
    q, g = figures["queue_wait_ms"], figures["idle_gap_ms"]
    goal = "met" if figures["share_goal_met"] else "NOT met"
    return (
        f"{table(headers, rows)}\n"
        f"{figures['jobs']} jobs of {figures['max_tokens']} tokens in {figures['window_s']} s, "
        f"{figures['clients']} clients; {figures['tokens_per_s']} of {figures['nominal_tokens_per_s']} "
        "nominal tokens/s\n"
        f"worst share deviation {figures['worst_share_deviation']:.1%} (goal <= 10%: {goal})\n"
        f"queue wait p50 {q['p50']} ms, p99 {q['p99']} ms; idle-while-waiting gaps p50 {g['p50']} ms, "
        f"p99 {g['p99']} ms, max {g['max']} ms"
    )
