"""`ortfleet bench tokens`: the token plane (workers' stream writes, Redis, the gateways' relay, SSE) at a
GPU's rates, without a GPU.

Fake-engine workers step many rows at a set step time (64 rows every 5 ms by default, as an H200 worker
ran the default model); closed-loop clients, in processes of their own, keep a set number of job streams
open: each submits a job, reads its events over SSE to the end, and submits the next. For each
`--coalesce-ms` value a fleet of its own, and in it each `--streams` level, measured over a window after a
warm-up:

- tokens/s the clients received, and what each generated token cost: Redis' CPU (INFO cpu) and commands
  (INFO commandstats), the gateways' CPU and the workers' CPU;
- relay latency: an event's arrival at its client less the time in its stream entry's id (Redis' clock,
  the same machine's);
- what the clients saw: the gap between a stream's events, tokens an event, time to first token.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import time
from array import array
from dataclasses import asdict, dataclass, field
from multiprocessing.synchronize import Event as EventType
from typing import Any

import httpx
import orjson
from redis.asyncio import Redis
from tqdm import tqdm

from common import aio
from common.redis_client import connect
from ortfleet.bench.http import Connection
from ortfleet.bench.machine import child_pids, cpu_seconds, describe
from ortfleet.bench.redis_load import read_jobs, redis_counters
from ortfleet.bench.report import table
from ortfleet.bench.stats import summary
from ortfleet.fleet.launcher import FleetProcess, LocalFleet, throwaway_fleet
from ortfleet.fleet.processes import free_port

MODEL = "bench-tokens"
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TokenPlaneOptions:
    workers: int  # fake-engine workers
    rows: int  # each worker's rows per step
    step_ms: float  # each worker's step time
    streams: list[int]  # open job streams, one level each
    max_tokens: int  # tokens per job
    seconds: float  # measured per level
    warmup_s: float  # before each level's window
    gateways: int
    client_processes: int
    coalesce_ms: list[float]  # ORTFLEET_STREAM_COALESCE_MS, one fleet each (0: off)
    writes_per_s: float  # ORTFLEET_STREAM_WRITES_PER_S
    stores: list[int] = field(default_factory=lambda: [1])  # Redis stores of the model, a fleet each
    engine_core: str = "off"  # ORTFLEET_ENGINE_CORE of the workers: off, or process (a fake engine core)
    cluster: int = 0  # primaries of a Redis Cluster as each fleet's Redis (0: standalone servers)


@dataclass
class _Seen:
    """What one client process saw, as flat arrays (cheap to pass between processes)."""

    received: array[float]  # each token event's arrival (time.time())
    latency_s: array[float]  # arrival less its entry id's time
    tokens: array[int]  # tokens the event carried
    gaps_s: array[float]  # between a stream's consecutive token events
    gap_at: array[float]  # the arrival that ended each gap
    ttft_s: array[float]  # submission to first token event
    ttft_at: array[float]
    ended_at: array[float]  # each job's final event's arrival


def run(options: TokenPlaneOptions) -> dict[str, Any]:
    runs = []
    for stores in options.stores:
        for coalesce_ms in options.coalesce_ms:
            env = {
                "ORTFLEET_STREAM_COALESCE_MS": f"{coalesce_ms:g}",
                "ORTFLEET_STREAM_WRITES_PER_S": f"{options.writes_per_s:g}",
                "ORTFLEET_MAX_QUEUED_JOBS": "100000000",
                "ORTFLEET_MAX_QUEUED_TOKENS": "1000000000000",
            }
            with throwaway_fleet(env, cluster=options.cluster) as fleet:
                urls = fleet.spread_model(MODEL, stores, appendonly=False)
                gateways = fleet.start_gateways(options.gateways, port=free_port())
                workers = _start_workers(fleet, options, stores)
                url = gateways[0].url
                per_job = aio.run(_job_cost(url, urls))
                for streams in options.streams:
                    level = _level(options, urls, url, gateways, workers, streams)
                    runs.append(
                        {
                            "stores": stores,
                            "cluster": options.cluster,
                            "coalesce_ms": coalesce_ms,
                            **_token_plane_cost(level, per_job),
                        }
                    )
    return {
        "bench": "tokens",
        "machine": describe(),
        "options": asdict(options),
        "levels": runs,
    }


@dataclass(frozen=True)
class _JobCost:
    """What one job of one token costs Redis beside its tokens, its whole life (submitted, claimed, run,
    ended and read over SSE), on every store together."""

    cpu_s: float
    commands: float  # those inside scripts included; the fleet's periodic reads in the window too


async def _job_cost(url: str, redis_urls: list[str], jobs: int = 200) -> _JobCost:
    redises: list[Redis] = [connect(redis_url) for redis_url in redis_urls]

    async def counters() -> tuple[int, float]:
        each = [await redis_counters(redis) for redis in redises]
        return sum(calls for calls, _ in each), sum(cpu for _, cpu in each)

    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await read_jobs(client, jobs // 4, 1, model=MODEL)  # warm-up: scripts loaded, connections open
            calls_before, cpu_before = await counters()
            await read_jobs(client, jobs, 1, model=MODEL)
            calls_after, cpu_after = await counters()
    finally:
        for redis in redises:
            await redis.aclose()
    # The second read of the counters counts in the commands: 2 INFO calls a store.
    commands = calls_after - calls_before - 2 * len(redises)
    return _JobCost((cpu_after - cpu_before) / jobs, commands / jobs)


def _token_plane_cost(level: dict[str, Any], per_job: _JobCost) -> dict[str, Any]:
    """The level's Redis CPU per token less what the jobs ended in its window cost beside their tokens."""
    tokens, jobs = level["tokens"], level["jobs_ended"]
    if not tokens:
        return level
    total = level["redis_cpu_us_per_token"]
    plane = total - jobs * per_job.cpu_s * 1e6 / tokens
    return {
        **level,
        "redis_cpu_us_per_job": round(per_job.cpu_s * 1e6, 1),
        "redis_commands_per_job": round(per_job.commands, 1),
        "redis_cpu_us_per_token_plane": round(plane, 2),
    }


def _start_workers(fleet: LocalFleet, options: TokenPlaneOptions, stores: int) -> list[FleetProcess]:
    """The fake-engine workers, spread over the model's stores in turn."""
    spec = f"{options.step_ms:g}:{options.rows}"
    workers = [
        fleet.start_worker(
            MODEL,
            "--fake-engine",
            spec,
            env={"ORTFLEET_STORE": str(i % stores + 1), "ORTFLEET_ENGINE_CORE": options.engine_core},
        )
        for i in range(options.workers)
    ]
    fleet.await_workers(MODEL, options.workers, workers)
    return workers


def _level(
    options: TokenPlaneOptions,
    redis_urls: list[str],
    url: str,
    gateways: list[FleetProcess],
    workers: list[FleetProcess],
    streams: int,
) -> dict[str, Any]:
    processes = max(1, min(options.client_processes, streams))
    context = multiprocessing.get_context("spawn")
    started, stop = context.Barrier(processes + 1), context.Event()
    outcomes: Any = context.Queue()
    clients = [
        context.Process(
            target=_client_process,
            args=(url, (streams + i) // processes, options.max_tokens, started, stop, outcomes),
            daemon=True,
        )
        for i in range(processes)
    ]
    for client in clients:
        client.start()
    started.wait(_START_TIMEOUT_S)
    measured = aio.run(_measure(options, redis_urls, gateways, workers, streams))
    stop.set()
    seen: list[_Seen] = []
    try:
        for _ in clients:
            error, part = outcomes.get(timeout=_START_TIMEOUT_S + options.max_tokens)
            if error is not None:
                raise RuntimeError(f"a client process failed: {error}")
            seen.append(part)
    finally:
        for client in clients:
            client.join(timeout=10)
            if client.is_alive():
                client.kill()
    return {"streams": streams, **_figures(measured, seen, options, streams)}


async def _measure(
    options: TokenPlaneOptions,
    redis_urls: list[str],
    gateways: list[FleetProcess],
    workers: list[FleetProcess],
    streams: int,
) -> dict[str, Any]:
    """Counters at the window's ends: Redis' commands and CPU (each store's), the gateways' and workers'
    CPU."""
    redises: list[Redis] = [connect(redis_url) for redis_url in redis_urls]
    try:
        with tqdm(
            total=round(options.warmup_s + options.seconds),
            desc=f"{streams} streams",
            unit="s",
            file=sys.stderr,
            leave=False,
        ) as bar:
            await asyncio.sleep(options.warmup_s)
            bar.update(round(options.warmup_s))
            before = await _counters(redises, gateways, workers)
            for _ in range(round(options.seconds)):
                await asyncio.sleep(options.seconds / round(options.seconds))
                bar.update()
            after = await _counters(redises, gateways, workers)
    finally:
        for redis in redises:
            await redis.aclose()
    return {"before": before, "after": after}


async def _counters(
    redises: list[Redis], gateways: list[FleetProcess], workers: list[FleetProcess]
) -> dict[str, Any]:
    counted: dict[str, Any] = {"at": time.time(), "redis_commands": 0, "redis_cpu_s": 0.0, "store_cpu_s": []}
    for redis in redises:
        commands, redis_cpu = await redis_counters(redis)
        counted["redis_commands"] += commands
        counted["redis_cpu_s"] += redis_cpu
        counted["store_cpu_s"].append(redis_cpu)
        for name, v in (await redis.info("commandstats")).items():
            key = f"usec:{name.removeprefix('cmdstat_')}"
            counted[key] = counted.get(key, 0.0) + float(v["usec"])
    counted["gateway_cpu_s"] = sum(cpu_seconds(gateway.pid) for gateway in gateways)
    counted["worker_cpu_s"] = sum(cpu_seconds(worker.pid) for worker in workers)
    # the workers' engine cores, where they run one (ORTFLEET_ENGINE_CORE=process): their children
    counted["core_cpu_s"] = sum(cpu_seconds(core) for worker in workers for core in child_pids(worker.pid))
    return counted


def _figures(
    measured: dict[str, Any], seen: list[_Seen], options: TokenPlaneOptions, streams: int
) -> dict[str, Any]:
    before, after = measured["before"], measured["after"]
    start, end = before["at"], after["at"]
    elapsed = end - start

    def within(values: list[array[Any]], at: list[array[float]]) -> list[float]:
        pairs = (zip(part, times, strict=True) for part, times in zip(values, at, strict=True))
        return [value for pair in pairs for value, t in pair if start <= t < end]

    tokens = sum(within([s.tokens for s in seen], [s.received for s in seen]))
    events = len(within([s.tokens for s in seen], [s.received for s in seen]))
    jobs_ended = len(within([s.ended_at for s in seen], [s.ended_at for s in seen]))

    def per_token_us(key: str) -> float | None:
        return round((after[key] - before[key]) / tokens * 1e6, 2) if tokens else None

    rows = min(streams, options.workers * options.rows)
    busy = [a - b for a, b in zip(after["store_cpu_s"], before["store_cpu_s"], strict=True)]
    by_command = {
        key.removeprefix("usec:"): round((after[key] - before.get(key, 0.0)) / tokens, 3)
        for key in after
        if key.startswith("usec:") and tokens and after[key] > before.get(key, 0.0)
    }
    return {
        "window_s": round(elapsed, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        "jobs_ended": jobs_ended,
        "engine_tokens_per_s_at_step_time": round(rows * 1000 / options.step_ms, 1),
        "tokens_per_event": round(tokens / events, 2) if events else None,
        "redis_cpu_us_per_token": per_token_us("redis_cpu_s"),
        "redis_commands_per_token": round((after["redis_commands"] - before["redis_commands"]) / tokens, 3)
        if tokens
        else None,
        "redis_cpu_cores": round((after["redis_cpu_s"] - before["redis_cpu_s"]) / elapsed, 3),
        # each store's Redis, and the tokens/s at which the busiest one would fill its core
        "store_cpu_cores": [round(b / elapsed, 3) for b in busy],
        "tokens_per_s_at_busiest_redis_core": round(tokens / max(busy), 0) if tokens and max(busy) else None,
        # Redis' own time in each command, per token (a script's includes the commands it runs)
        "redis_command_us_per_token": dict(sorted(by_command.items(), key=lambda item: -item[1])),
        "gateway_cpu_us_per_token": per_token_us("gateway_cpu_s"),
        "worker_cpu_us_per_token": per_token_us("worker_cpu_s"),
        "core_cpu_us_per_token": per_token_us("core_cpu_s") if options.engine_core != "off" else None,
        "relay_latency_ms": summary(within([s.latency_s for s in seen], [s.received for s in seen])),
        "event_gap_ms": summary(within([s.gaps_s for s in seen], [s.gap_at for s in seen])),
        "ttft_ms": summary(within([s.ttft_s for s in seen], [s.ttft_at for s in seen])),
    }


def _client_process(
    url: str, lanes: int, max_tokens: int, started: Any, stop: EventType, outcomes: Any
) -> None:
    try:
        seen = aio.run(_clients(url, lanes, max_tokens, started, stop))
    except BaseException as e:
        outcomes.put((f"{type(e).__name__}: {e}", None))
        return
    outcomes.put((None, seen))


async def _clients(url: str, lanes: int, max_tokens: int, started: Any, stop: EventType) -> _Seen:
    seen = _Seen(
        received=array("d"),
        latency_s=array("d"),
        tokens=array("q"),
        gaps_s=array("d"),
        gap_at=array("d"),
        ttft_s=array("d"),
        ttft_at=array("d"),
        ended_at=array("d"),
    )
    # perf_counter stamps the events; time.time() is what Redis' entry ids are on
    wall = time.time() - time.perf_counter()
    await asyncio.to_thread(started.wait, _START_TIMEOUT_S)

    async def lane() -> None:
        connection = Connection(url)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens}
        try:
            while not stop.is_set():
                sent = time.perf_counter()
                job = await connection.json("POST", "/v1/jobs", body, expect=202)
                last = None
                async for event in connection.events(f"/v1/jobs/{job['id']}/events"):
                    if event.event != "token":
                        if event.event in ("done", "error"):
                            seen.ended_at.append(event.received + wall)
                            break
                        continue
                    arrived = event.received + wall
                    seen.received.append(arrived)
                    seen.latency_s.append(arrived - int(event.id.partition("-")[0]) / 1000)
                    seen.tokens.append(len(orjson.loads(event.data)["token_ids"]))
                    if last is None:
                        seen.ttft_s.append(event.received - sent)
                        seen.ttft_at.append(arrived)
                    else:
                        seen.gaps_s.append(event.received - last)
                        seen.gap_at.append(arrived)
                    last = event.received
        finally:
            await connection.close()

    await asyncio.gather(*(lane() for _ in range(lanes)))
    return seen


def _thousands(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def text(figures: dict[str, Any]) -> str:
    options = figures["options"]
    core = "" if options.get("engine_core", "off") == "off" else " (each in an engine core of its own)"
    cluster = options.get("cluster", 0)
    on = f", stores on a Redis Cluster of {cluster} primaries" if cluster else ""
    head = (
        f"{options['workers']} fake-engine worker(s) of {options['rows']} rows every "
        f"{options['step_ms']:g} ms{core}, "
        f"{options['gateways']} gateway(s), jobs of {options['max_tokens']} tokens{on}"
    )
    rows = []
    for level in figures["levels"]:
        relay, gap, ttft = level["relay_latency_ms"], level["event_gap_ms"], level["ttft_ms"]
        rows.append(
            [
                level.get("stores", 1),
                f"{level['coalesce_ms']:g}",
                level["streams"],
                f"{level['tokens_per_s']:,.0f}",
                level["tokens_per_event"],
                level["redis_cpu_us_per_token"],
                level.get("redis_cpu_us_per_token_plane"),
                level["redis_commands_per_token"],
                level["gateway_cpu_us_per_token"],
                level["worker_cpu_us_per_token"],
                level.get("core_cpu_us_per_token") or "-",
                f"{relay.get('p50', '-')} / {relay.get('p99', '-')}",
                f"{gap.get('p50', '-')}",
                f"{ttft.get('p50', '-')}",
                _thousands(level.get("tokens_per_s_at_busiest_redis_core")),
            ]
        )
    header = [
        "stores",
        "coalesce ms",
        "streams",
        "tokens/s",
        "tokens/event",
        "Redis µs/token",
        "of it tokens' own",
        "Redis cmds/token",
        "gateway µs/token",
        "worker µs/token",
        "core µs/token",
        "relay p50 / p99 ms",
        "event gap p50 ms",
        "TTFT p50 ms",
        "tokens/s at a full Redis core",
    ]
    costs = {
        (level.get("stores", 1), f"{level['coalesce_ms']:g}"): (
            level.get("redis_cpu_us_per_job"),
            level.get("redis_commands_per_job"),
        )
        for level in figures["levels"]
    }
    per_job = ", ".join(
        f"{cpu} µs and {commands} commands ({n} store(s), coalesce {ms} ms)"
        for (n, ms), (cpu, commands) in costs.items()
    )
    return (
        head
        + "\n"
        + table(header, rows)
        + f"\nRedis CPU per job beside its tokens (200 jobs of 1 token): {per_job}; the tokens' own cost "
        "is the level's Redis CPU less that for each job ended in its window"
    )
