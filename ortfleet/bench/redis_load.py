"""`ortfleet bench redis`: what one Redis primary costs and carries.

Costs: a real gateway and a fake-engine worker on a Redis of their own; jobs of 1 and of N tokens are
submitted and read to their end over SSE, and Redis' own counters (INFO commandstats, INFO cpu) give the
commands and CPU seconds of each run. Fitting cost(job) = per submission + tokens x per token to the two
runs separates the two.

Ceiling: a synthetic publisher (standing in for the workers) writes token entries to S open SSE streams at
a rising rate; at each step the relay latency (publish -> receipt) and Redis' CPU are measured, until relay
p99 passes the target. A Redis primary runs commands on one thread, so its CPU per token event also gives
the rate at which it would be saturated on its own.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
from redis.asyncio import Redis

from common import aio
from common.redis_client import connect
from ortfleet.bench import capacity
from ortfleet.bench.machine import describe
from ortfleet.bench.report import table
from ortfleet.fleet.launcher import LocalFleet, throwaway_fleet

MODEL = "bench-redis"
FAKE_ENGINE = "1:16"  # 1 ms per token, 16 jobs together: the engine is never what limits
JOB_LIMIT_S = 120.0  # a job of the cost runs that has not ended by then never will: the bench fails


@dataclass(frozen=True)
class RedisLoadOptions:
    jobs: int  # per cost run
    max_tokens: int  # tokens per job in the long run (the short one makes 1)
    streams: int  # open SSE streams in the ceiling steps
    rates: list[float]  # token events per second per stream, one step each
    step_s: float  # seconds of publishing per step
    p99_target_ms: float


async def redis_counters(redis: Redis) -> tuple[int, float]:
    """Commands Redis has run (those inside scripts included) and its CPU seconds, user + system."""
    stats = await redis.info("commandstats")
    calls = sum(int(entry["calls"]) for entry in stats.values() if isinstance(entry, dict))
    cpu = await redis.info("cpu")
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def run(options: RedisLoadOptions) -> dict[str, Any]:
    env = {"ORTFLEET_MAX_QUEUED_JOBS": "100000000", "ORTFLEET_MAX_QUEUED_TOKENS": "1000000000000"}
    with throwaway_fleet(env) as fleet:
        _, url = fleet.start_gateway()
        fleet.start_worker(MODEL, "--fake-engine", FAKE_ENGINE, wait=True)
        costs = aio.run(_costs(options, url, fleet.redis_url))
    with throwaway_fleet(env) as fleet:
        ceiling = _ceiling(options, fleet)
    per_token_us = costs["per_token"]["cpu_us"]
    return {
        "bench": "redis",
        # Redis runs commands on one thread: one core spent on tokens alone, at a fleet's full cost per token.
        "redis_saturation_tokens_per_s": round(1e6 / per_token_us) if per_token_us > 0 else None,
        "machine": describe(),
        "options": options.__dict__,
        "costs": costs,
        "ceiling": ceiling,
    }


async def _costs(options: RedisLoadOptions, url: str, redis_url: str) -> dict[str, Any]:
    redis = connect(redis_url)
    runs = {}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for tokens in (1, options.max_tokens):
                await read_jobs(client, options.jobs, tokens)  # warm-up: scripts loaded, connections open
                calls_before, cpu_before = await redis_counters(redis)
                started = time.perf_counter()
                await read_jobs(client, options.jobs, tokens)
                elapsed = time.perf_counter() - started
                calls_after, cpu_after = await redis_counters(redis)
                runs[tokens] = {
                    "jobs": options.jobs,
                    "tokens_per_job": tokens,
                    "commands": calls_after - calls_before,
                    "cpu_s": round(cpu_after - cpu_before, 4),
                    "elapsed_s": round(elapsed, 2),
                }
    finally:
        await redis.aclose()
    short, long = runs[1], runs[options.max_tokens]
    extra_tokens = (options.max_tokens - 1) * options.jobs
    per_token_commands = (long["commands"] - short["commands"]) / extra_tokens
    per_token_cpu = (long["cpu_s"] - short["cpu_s"]) / extra_tokens
    return {
        "runs": list(runs.values()),
        "per_submission": {
            "commands": round(short["commands"] / options.jobs - per_token_commands, 1),
            "cpu_us": round((short["cpu_s"] / options.jobs - per_token_cpu) * 1e6, 1),
        },
        "per_token": {"commands": round(per_token_commands, 3), "cpu_us": round(per_token_cpu * 1e6, 2)},
    }


async def read_jobs(
    client: httpx.AsyncClient, count: int, tokens: int, concurrency: int = 16, model: str = MODEL
) -> None:
    """`count` jobs of `tokens` tokens, each submitted, then read over SSE to its end (as a client does)."""
    left = count

    async def lane() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            body = {"model": model, "prompt": "Hello", "max_tokens": tokens}
            reply = await client.post("/v1/jobs", json=body)
            reply.raise_for_status()
            job_id = reply.json()["id"]
            try:
                async with asyncio.timeout(JOB_LIMIT_S):
                    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
                        async for line in stream.aiter_lines():
                            if line in ("event: done", "event: error"):
                                break
            except TimeoutError:
                raise RuntimeError(f"job {job_id} did not end within {JOB_LIMIT_S:g} s") from None

    await asyncio.gather(*(lane() for _ in range(concurrency)))


def _ceiling(options: RedisLoadOptions, fleet: LocalFleet) -> dict[str, Any]:
    _, url = fleet.start_gateway()
    gateway_pid = fleet.gateways[0].pid
    steps = []
    for rate in options.rates:
        aio.run(_reset(fleet.redis_url))
        step = capacity.CapacityOptions(options.streams, rate, options.step_s, 0, 1)
        before = aio.run(_counters(fleet.redis_url))
        figures = aio.run(capacity.stream_step(step, url, fleet.redis_url, gateway_pid))
        after = aio.run(_counters(fleet.redis_url))
        events = max(1, figures["events_published"])
        redis_cpu_s = after[1] - before[1]
        steps.append(
            {
                "streams": options.streams,
                "tokens_per_s": round(figures["events_per_s"], 1),
                "relay_p99_ms": figures["relay_latency_ms"]["p99"],
                "relay_p50_ms": figures["relay_latency_ms"]["p50"],
                "redis_cpu_cores": round(redis_cpu_s / options.step_s, 3),
                "redis_cpu_us_per_token": round(redis_cpu_s / events * 1e6, 2),
                "gateway_cpu_cores": figures["gateway_cpu_cores"],
            }
        )
        p99 = figures["relay_latency_ms"]["p99"]
        if p99 is None or p99 > options.p99_target_ms:
            break
    within = [
        s for s in steps if s["relay_p99_ms"] is not None and s["relay_p99_ms"] <= options.p99_target_ms
    ]
    best = max(within, key=lambda s: s["tokens_per_s"]) if within else None
    # The marginal Redis CPU of a relayed token: the CPU added from the first step to the last over the
    # tokens/s added (what the steps share, idle cron and open connections, drops out).
    marginal_us = None
    if len(steps) >= 2 and steps[-1]["tokens_per_s"] > steps[0]["tokens_per_s"]:
        added_cpu = steps[-1]["redis_cpu_cores"] - steps[0]["redis_cpu_cores"]
        marginal_us = round(added_cpu / (steps[-1]["tokens_per_s"] - steps[0]["tokens_per_s"]) * 1e6, 2)
    return {
        "steps": steps,
        "p99_target_ms": options.p99_target_ms,
        "carried_within_target": best,
        "relay_cpu_us_per_token": marginal_us,
    }


async def _reset(redis_url: str) -> None:
    redis = connect(redis_url)
    await redis.flushdb()
    await redis.aclose()


async def _counters(redis_url: str) -> tuple[int, float]:
    redis = connect(redis_url)
    try:
        return await redis_counters(redis)
    finally:
        await redis.aclose()


def text(figures: dict[str, Any]) -> str:
    costs, ceiling = figures["costs"], figures["ceiling"]
    sub, tok = costs["per_submission"], costs["per_token"]
    rows: list[list[Any]] = [
        ["Redis commands per submission", sub["commands"]],
        ["Redis CPU per submission (us)", sub["cpu_us"]],
        ["Redis commands per generated token", tok["commands"]],
        ["Redis CPU per generated token (us)", tok["cpu_us"]],
    ]
    for step in ceiling["steps"]:
        rows.append(
            [
                f"{step['streams']} streams, {step['tokens_per_s']} tokens/s",
                f"relay p50/p99 {step['relay_p50_ms']}/{step['relay_p99_ms']} ms, Redis "
                f"{step['redis_cpu_cores']} cores, gateway {step['gateway_cpu_cores']} cores",
            ]
        )
    best = ceiling["carried_within_target"]
    rows.append(
        [
            f"carried with relay p99 <= {ceiling['p99_target_ms']:g} ms",
            f"{best['tokens_per_s']} tokens/s over {best['streams']} streams" if best else "none",
        ]
    )
    rows.append(["Redis CPU per relayed token, marginal (us)", ceiling["relay_cpu_us_per_token"]])
    rows.append(["one Redis core spent on tokens (tokens/s)", figures["redis_saturation_tokens_per_s"]])
    return table(["redis", "value"], rows)
