"""`ortfleet bench fairness`: priority classes and fair share between keys, on fake engines behind the
real gateway, queue and workers.

Scenario A: a flood key submits batch jobs as fast as it can while a light key sends one interactive
job every half second; the light key's queue wait and time to first token are compared with the same
jobs on an idle fleet. Every flood job that finished is checked against the text the fake engine
generates: preempted and resumed jobs must read exactly as if they had never stopped.

Scenario B: two keys keep the fleet saturated (closed-loop clients, more than the fleet's slots each);
their shares of the tokens served are compared with their weights, 1:1 and then 3:1.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any

from common import aio
from common.fleet_stats import served_tokens
from common.jobs.record import JobRecord
from common.keys import STANDALONE as keys  # benchmarks run on one Redis
from common.redis_client import connect
from common.wire import JobStatus
from ortfleet.bench.http import Connection, HttpError
from ortfleet.bench.machine import describe
from ortfleet.bench.report import table
from ortfleet.bench.stats import summary
from ortfleet.fleet.launcher import throwaway_fleet

NAME = "bench-fair"
PROMPT = "Hello"
GOAL_SHARE_DEVIATION = 0.05
GOAL_TTFT_RATIO = 1.5


@dataclass(frozen=True)
class FairnessOptions:
    workers: list[str]  # DELAY_MS:CAPACITY of each fake-engine worker
    duration_s: float  # of each phase
    flood_jobs: int
    flood_tokens: int
    light_tokens: int
    interval_s: float
    share_tokens: int
    preempt: bool = True


def _key() -> str:
    return "ofk_bench_" + secrets.token_urlsafe(16)


def expected_text(count: int) -> str:
    """What the fake engine generates after PROMPT: letters by absolute position."""
    return "".join(chr(ord("a") + (len(PROMPT) + i) % 26) for i in range(count))


def run(options: FairnessOptions) -> dict[str, Any]:
    tokens = {name: _key() for name in ("light", "flood", "even-a", "even-b", "heavy", "plain")}
    weights = {"heavy": 3}
    env_keys = ",".join(f"{name}:{token}:{weights.get(name, 1)}" for name, token in tokens.items())
    env = {
        "ORTFLEET_MAX_QUEUED_JOBS": "1000000",
        "ORTFLEET_API_KEYS": env_keys,
        "ORTFLEET_KEY_MAX_CONCURRENT_JOBS": "1000000",
        "ORTFLEET_KEY_REQUESTS_PER_MINUTE": "1000000",
    }
    worker_env = {"ORTFLEET_PREEMPT_BATCH": "true" if options.preempt else "false"}
    with throwaway_fleet(env) as fleet:
        _, url = fleet.start_gateway()
        for spec in options.workers:
            fleet.start_worker(NAME, "--fake-engine", spec, wait=False, env=worker_env)
        fleet.wait_workers(NAME, len(options.workers), timeout_s=120)
        return aio.run(_scenarios(options, url, fleet.redis_url, tokens))


async def _scenarios(
    options: FairnessOptions, url: str, redis_url: str, tokens: dict[str, str]
) -> dict[str, Any]:
    redis = connect(redis_url)
    try:
        print("scenario A: idle fleet", file=sys.stderr)
        idle_ids = await _light_jobs(url, tokens["light"], options)
        print("scenario A: with the batch flood", file=sys.stderr)
        flood = asyncio.create_task(_flood(url, tokens["flood"], options))
        await asyncio.sleep(1.0)  # the flood fills every slot first
        served_before, began = await served_tokens(redis, keys, NAME), time.monotonic()
        loaded_ids = await _light_jobs(url, tokens["light"], options)
        served_after, ended = await served_tokens(redis, keys, NAME), time.monotonic()
        flood_rate = (int(served_after.get("batch", 0)) - int(served_before.get("batch", 0))) / (
            ended - began
        )
        flood_ids = await flood
        await asyncio.sleep(0.5)
        idle = await _records(redis, idle_ids)
        loaded = await _records(redis, loaded_ids)
        flooded = await _records(redis, flood_ids)
        scenario_a = _scenario_a(idle, loaded, flooded, options)
        scenario_a["flood_served_tokens_per_s"] = round(flood_rate, 1)
        for job_id in flood_ids:  # what is left of the flood would only slow scenario B
            await redis.delete(keys.job(job_id))
        for cls in ("interactive", "batch"):
            await redis.delete(keys.queue(NAME, cls))
        print("scenario B: weights 1:1, then 3:1", file=sys.stderr)
        even = await _shares(url, redis, {"even-a": tokens["even-a"], "even-b": tokens["even-b"]}, options)
        weighted = await _shares(url, redis, {"heavy": tokens["heavy"], "plain": tokens["plain"]}, options)
    finally:
        await redis.aclose()
    return {
        "bench": "fairness",
        "machine": describe(),
        "workers": options.workers,
        "preempt_batch": options.preempt,
        "scenario_a": scenario_a,
        "scenario_b": [
            _share_figures(even, {"even-a": 1, "even-b": 1}),
            _share_figures(weighted, {"heavy": 3, "plain": 1}),
        ],
    }


async def _light_jobs(url: str, token: str, options: FairnessOptions) -> list[str]:
    """One interactive job every interval for the phase; waits for each to end."""
    body = {
        "model": NAME,
        "prompt": PROMPT,
        "max_tokens": options.light_tokens,
        "min_tokens": options.light_tokens,
    }
    ids: list[str] = []
    waits: list[asyncio.Task[Any]] = []
    deadline = time.monotonic() + options.duration_s
    connection = Connection(url, headers={"Authorization": f"Bearer {token}"})
    try:
        while time.monotonic() < deadline:
            job = await connection.json("POST", "/v1/jobs", body, expect=202)
            ids.append(job["id"])
            waits.append(asyncio.create_task(_wait(url, token, job["id"])))
            await asyncio.sleep(options.interval_s)
        await asyncio.gather(*waits)
    finally:
        await connection.close()
    return ids


async def _wait(url: str, token: str, job_id: str) -> None:
    connection = Connection(url, headers={"Authorization": f"Bearer {token}"})
    try:
        await connection.json("GET", f"/v1/jobs/{job_id}?wait=60")
    finally:
        await connection.close()


async def _flood(url: str, token: str, options: FairnessOptions) -> list[str]:
    body = {
        "model": NAME,
        "prompt": PROMPT,
        "max_tokens": options.flood_tokens,
        "min_tokens": options.flood_tokens,
        "priority": "batch",
    }
    connection = Connection(url, headers={"Authorization": f"Bearer {token}"})
    ids = []
    try:
        for _ in range(options.flood_jobs):
            ids.append((await connection.json("POST", "/v1/jobs", body, expect=202))["id"])
    finally:
        await connection.close()
    return ids


async def _records(redis: Any, job_ids: list[str]) -> list[JobRecord]:
    async with redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        replies: list[dict[str, str]] = await pipe.execute()
    return [JobRecord.from_fields(raw) for raw in replies if raw]


def _timing(records: list[JobRecord], name: str) -> list[float]:
    values = [getattr(r.timings, name) for r in records if r.timings is not None]
    return [v for v in values if v is not None]


def _scenario_a(
    idle: list[JobRecord], loaded: list[JobRecord], flooded: list[JobRecord], options: FairnessOptions
) -> dict[str, Any]:
    done = [r for r in flooded if r.status is JobStatus.succeeded]
    wrong = [r.id for r in done if r.output != expected_text(options.flood_tokens)]
    failed = [r.id for r in flooded if r.status is JobStatus.failed]
    idle_ttft = summary(_timing(idle, "ttft_s"))
    loaded_ttft = summary(_timing(loaded, "ttft_s"))
    ratio = None
    if idle_ttft["p99"] and loaded_ttft["p99"]:
        ratio = round(loaded_ttft["p99"] / idle_ttft["p99"], 3)
    return {
        "flood_jobs": options.flood_jobs,
        "flood_tokens": options.flood_tokens,
        "light_tokens": options.light_tokens,
        "interval_s": options.interval_s,
        "light_jobs_idle": len(idle),
        "light_jobs_loaded": len(loaded),
        "light_failed": sum(1 for r in idle + loaded if r.status is not JobStatus.succeeded),
        "light_queue_wait_idle_ms": summary(_timing(idle, "queue_wait_s")),
        "light_queue_wait_loaded_ms": summary(_timing(loaded, "queue_wait_s")),
        "light_ttft_idle_ms": idle_ttft,
        "light_ttft_loaded_ms": loaded_ttft,
        "ttft_p99_ratio": ratio,
        "ttft_goal_met": ratio is not None and ratio <= GOAL_TTFT_RATIO,
        "flood_finished": len(done),
        "flood_preempted_jobs": sum(1 for r in flooded if r.preemptions),
        "flood_preemptions": sum(r.preemptions for r in flooded),
        "flood_failed": len(failed),
        "flood_wrong_output": len(wrong),
    }


async def _shares(url: str, redis: Any, tokens: dict[str, str], options: FairnessOptions) -> dict[str, int]:
    """Closed-loop clients per key for the phase; tokens served per key meanwhile (after a warm-up)."""
    body = {
        "model": NAME,
        "prompt": PROMPT,
        "max_tokens": options.share_tokens,
        "min_tokens": options.share_tokens,
    }
    deadline = time.monotonic() + options.duration_s
    clients_per_key = 24

    async def client(token: str) -> None:
        connection = Connection(url, headers={"Authorization": f"Bearer {token}"})
        try:
            while time.monotonic() < deadline:
                job = await connection.json("POST", "/v1/jobs", body, expect=202)
                with contextlib.suppress(HttpError):
                    await connection.json("GET", f"/v1/jobs/{job['id']}?wait=60")
        finally:
            await connection.close()

    tasks = [asyncio.create_task(client(t)) for t in tokens.values() for _ in range(clients_per_key)]
    await asyncio.sleep(min(2.0, options.duration_s / 4))
    before = await redis.hgetall(keys.served_tokens(NAME))
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    after = await redis.hgetall(keys.served_tokens(NAME))
    await asyncio.gather(*tasks)
    return {
        name: int(after.get(f"interactive:{name}", 0)) - int(before.get(f"interactive:{name}", 0))
        for name in tokens
    }


def _share_figures(served: dict[str, int], weights: dict[str, int]) -> dict[str, Any]:
    total = sum(served.values()) or 1
    weight_total = sum(weights.values())
    keys_out = []
    worst = 0.0
    for name, tokens in served.items():
        share, expected = tokens / total, weights[name] / weight_total
        worst = max(worst, abs(share - expected))
        keys_out.append(
            {
                "key": name,
                "weight": weights[name],
                "tokens": tokens,
                "share": round(share, 4),
                "expected": round(expected, 4),
            }
        )
    return {
        "weights": ":".join(str(w) for w in weights.values()),
        "keys": keys_out,
        "worst_share_deviation": round(worst, 4),
        "share_goal_met": worst <= GOAL_SHARE_DEVIATION,
    }


def text(figures: dict[str, Any]) -> str:
    a = figures["scenario_a"]
    lines = [
        f"scenario A: {a['flood_jobs']} batch jobs of {a['flood_tokens']} tokens from one key; one "
        f"interactive job of {a['light_tokens']} tokens every {a['interval_s']} s from another",
        table(
            ["light key", "jobs", "queue wait p50 ms", "p99 ms", "TTFT p50 ms", "p99 ms"],
            [
                [
                    phase,
                    a[f"light_jobs_{phase}"],
                    a[f"light_queue_wait_{phase}_ms"]["p50"],
                    a[f"light_queue_wait_{phase}_ms"]["p99"],
                    a[f"light_ttft_{phase}_ms"]["p50"],
                    a[f"light_ttft_{phase}_ms"]["p99"],
                ]
                for phase in ("idle", "loaded")
            ],
        ),
        f"TTFT p99 loaded/idle {a['ttft_p99_ratio']} (goal <= {GOAL_TTFT_RATIO}: "
        f"{'met' if a['ttft_goal_met'] else 'NOT met'}); light jobs not succeeded: {a['light_failed']}",
        f"flood: {a['flood_finished']} finished, {a['flood_preempted_jobs']} jobs preempted "
        f"({a['flood_preemptions']} times), {a['flood_failed']} failed, {a['flood_wrong_output']} with "
        f"output not exactly as generated; flood served {a['flood_served_tokens_per_s']} tokens/s "
        f"(prompt and generated) while the light key ran "
        f"(preemption {'on' if figures['preempt_batch'] else 'off'})",
        "",
        "scenario B: two saturating keys",
    ]
    for phase in figures["scenario_b"]:
        rows = [
            [k["key"], k["weight"], k["tokens"], f"{k['share']:.1%}", f"{k['expected']:.1%}"]
            for k in phase["keys"]
        ]
        lines.append(table(["key", "weight", "tokens", "share", "expected"], rows))
        goal = "met" if phase["share_goal_met"] else "NOT met"
        lines.append(
            f"weights {phase['weights']}: worst deviation {phase['worst_share_deviation']:.1%} "
            f"(goal <= 5%: {goal})"
        )
    return "\n".join(str(line) for line in lines)
