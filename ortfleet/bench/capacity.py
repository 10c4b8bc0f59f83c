"""`ortfleet bench gateway`: one gateway process alone, no model.

Streams: job records and event streams are created straight in Redis, the client opens one SSE
stream per job, and a synthetic publisher (a separate process, standing in for the workers) adds
token entries to every stream at a set rate, each carrying its publish time; the client measures
publish -> receipt. The publisher writes as workers do (the step-write script, whose notice carries
the entries), or with plain `XADD`s and a notice of the stream keys alone, which the relay answers
by reading the streams (`writer`). Submissions: keep-alive connections POST /v1/jobs as fast as the gateway
answers (a registered stand-in worker makes the model live; the jobs just queue).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import resource
import sys
import time
from array import array
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from tqdm import tqdm

from common import aio
from common.jobs.queue import JobQueue
from common.jobs.reads import notice_streams, stage_jobs
from common.jobs.record import JobRecord
from common.jobs.writes import StepWrite
from common.keys import STANDALONE as keys  # benchmarks run on one Redis
from common.redis_client import connect, gateway_client_name
from common.registry import WorkerInfo, heartbeat
from common.wire import JobStatus
from gateway.main import raise_open_file_limit
from ortfleet.bench.http import Connection
from ortfleet.bench.machine import cpu_seconds, describe, rss_bytes
from ortfleet.bench.report import table
from ortfleet.bench.stats import summary
from ortfleet.fleet.launcher import throwaway_fleet

MODEL = "bench-gateway"
WRITERS = {
    "step": "as workers do: the step-write script, entries in the notice",
    "plain": "XADD, and a notice of the stream keys alone (the relay reads them)",
}
OPEN_AT_ONCE = 128  # connections being opened at the same time


@dataclass(frozen=True)
class CapacityOptions:
    streams: int
    rate: float  # token events per second per stream
    duration_s: float
    submissions: int
    submit_concurrency: int
    writer: str = "step"  # "step": as workers write (entries in the notice); "plain": XADD + key notice


def run(options: CapacityOptions) -> dict[str, Any]:
    _open_file_limit_check(options.streams)
    env = {"ORTFLEET_MAX_QUEUED_JOBS": "100000000", "ORTFLEET_MAX_QUEUED_TOKENS": "1000000000000"}
    with throwaway_fleet(env) as fleet:
        _, url = fleet.start_gateway()
        gateway_pid = fleet.gateways[0].pid
        aio.run(_register_stand_in(fleet.redis_url))
        fleet.wait_workers(MODEL, 1)
        streams = aio.run(stream_step(options, url, fleet.redis_url, gateway_pid))
        submissions = aio.run(_submissions(options, url))
    return {
        "bench": "gateway",
        "machine": describe(),
        "options": options.__dict__,
        "streams": streams,
        "submissions": submissions,
    }


async def _register_stand_in(redis_url: str) -> None:
    redis = connect(redis_url)
    info = WorkerInfo(
        id="bench-stand-in",
        model=MODEL,
        device="cpu",
        gpu="",
        capacity=1,
        context_length=8192,
        continuous_batching=True,
        host="bench",
        pid=os.getpid(),
        started_at=time.time(),
    )
    await heartbeat(redis, keys, info, 3600, 3600)
    await redis.aclose()


def _job_ids(count: int) -> list[str]:
    return [f"bench_{i:06d}" for i in range(count)]


async def _create_jobs(redis_url: str, count: int) -> None:
    redis = connect(redis_url)
    now = time.time()
    running = [
        JobRecord(id=job_id, model=MODEL, status=JobStatus.running, created_at=now, attempts=1)
        for job_id in _job_ids(count)
    ]
    await stage_jobs(redis, keys, running, ttl_s=3600)
    await redis.aclose()


STREAMS_PER_CLIENT = 5000  # SSE streams one client process follows (its open files, its CPU)
FILES_BESIDE_STREAMS = 64  # a process's other open files: Redis connections, listening socket, stdio


def _open_file_limit_check(streams: int) -> None:
    """The gateway holds a socket per stream: stop early, saying so, when this machine cannot."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < streams + FILES_BESIDE_STREAMS:
        raise SystemExit(
            f"ortfleet bench gateway: one process may hold at most {hard} open files here (ulimit -Hn), "
            f"and {streams} streams need about {streams + FILES_BESIDE_STREAMS} in the gateway; "
            f"raise the hard limit (root with CAP_SYS_RESOURCE: ulimit -Hn, or LimitNOFILE in a systemd "
            f"unit) or ask for at most {hard - FILES_BESIDE_STREAMS} streams"
        )


async def stream_step(options: CapacityOptions, url: str, redis_url: str, gateway_pid: int) -> dict[str, Any]:
    await _create_jobs(redis_url, options.streams)
    rss_before = rss_bytes(gateway_pid)
    collections = [await gc_pauses(url)]
    context = multiprocessing.get_context("spawn")
    opened, failed = context.Value("q", 0), context.Value("q", 0)
    published_all = context.Event()
    results: multiprocessing.Queue[tuple[bytes, bytes, int]] = context.Queue()
    ids = _job_ids(options.streams)
    shares = [ids[i : i + STREAMS_PER_CLIENT] for i in range(0, len(ids), STREAMS_PER_CLIENT)]
    clients = [
        context.Process(target=follow, args=(url, share, opened, failed, published_all, results), daemon=True)
        for share in shares
    ]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 300
    with tqdm(
        total=options.streams, desc="opening SSE streams", unit="stream", file=sys.stderr, leave=False
    ) as bar:
        while (done := opened.value + failed.value) < options.streams and time.monotonic() < deadline:
            bar.update(done - bar.n)
            await asyncio.sleep(0.5)
    if opened.value + failed.value < options.streams:
        raise RuntimeError(f"only {opened.value} of {options.streams} streams opened in 300 s")
    open_streams, failed_opens = opened.value, failed.value
    await asyncio.sleep(1.0)
    rss_open = rss_bytes(gateway_pid)
    collections.append(await gc_pauses(url))
    connections = [await gateway_connections(redis_url, gateway_pid)]

    start = context.Event()
    published = context.Value("q", 0)
    publisher = context.Process(
        target=publish,
        args=(redis_url, options, start, published),
        daemon=True,
    )
    publisher.start()
    reads_before = await relay_reads(redis_url)
    cpu_before = cpu_seconds(gateway_pid)
    started = time.perf_counter()
    start.set()
    with tqdm(total=round(options.duration_s), desc="relaying", unit="s", file=sys.stderr, leave=False) as b:
        while publisher.is_alive() and time.perf_counter() - started < options.duration_s + 60:
            await asyncio.sleep(1.0)
            connections.append(await gateway_connections(redis_url, gateway_pid))
            b.update()
    publisher.join(10)
    elapsed = time.perf_counter() - started
    gateway_cpu = (cpu_seconds(gateway_pid) - cpu_before) / elapsed
    reads = await relay_reads(redis_url) - reads_before
    collections.append(await gc_pauses(url))
    published_all.set()
    sent_at: list[float] = []
    latencies: list[float] = []
    unfinished = 0
    for _ in clients:
        sent, received, stalled = await asyncio.to_thread(results.get, True, FOLLOW_GRACE_S + 60)
        sent_at.extend(array("d", sent))
        latencies.extend(array("d", received))
        unfinished += stalled
    for client in clients:
        client.join(10)
    return {
        "open_streams": open_streams,
        "client_processes": len(clients),
        "streams_failed": unfinished,  # never opened, or never reached their end
        "opens_failed": failed_opens,
        "events_published": published.value,
        "events_received": len(latencies),
        "events_per_s": round(len(latencies) / options.duration_s, 1),
        "relay_latency_ms": summary(latencies),
        "relay_latency_p99_ms_by_second": _p99_by_second(sent_at, latencies, started),
        "gateway_cpu_cores": round(gateway_cpu, 3),
        "relay_reads": reads,  # XREADs while relaying: only sweeps' when notices carry entries
        "gateway_rss_mb": {"idle": round(rss_before / 2**20, 1), "open": round(rss_open / 2**20, 1)},
        "memory_per_stream_kb": round((rss_open - rss_before) / options.streams / 1024, 1),
        "redis_connections": {"streams_open": connections[0], "max_while_relaying": max(connections)},
        "gc_pauses": {
            "while_opening": _between(collections[0], collections[1]),
            "while_relaying": _between(collections[1], collections[2]),
        },
    }


async def gc_pauses(url: str) -> dict[str, float]:
    """The gateway's garbage collections so far (`ortfleet_gc_pause_seconds`): how many, how many of
    them full, how many stood the event loop still for more than 50 ms, and their seconds in all."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        exposition = (await http.get("/metrics")).raise_for_status().text
    pauses = {"collections": 0.0, "full": 0.0, "over_50ms": 0.0, "seconds": 0.0}
    for family in text_string_to_metric_families(exposition):
        if family.name != "ortfleet_gc_pause_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                pauses["collections"] += sample.value
                pauses["full"] += sample.value if sample.labels["generation"] == "2" else 0
                pauses["over_50ms"] += sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == 0.05:
                pauses["over_50ms"] -= sample.value
            elif sample.name.endswith("_sum"):
                pauses["seconds"] += sample.value
    return pauses


def _between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before[name], 4) for name in before}


FOLLOW_GRACE_S = 60.0  # after the last publish, how long a stream may take to reach its end


def follow(
    url: str, job_ids: list[str], opened: Any, failed: Any, published_all: EventType, results: Any
) -> None:
    """One client process (its own open files and core time): follows `job_ids`' SSE streams and puts
    the publish time and publish -> receipt latency of every token event, and the streams that never
    ended, on `results`."""
    raise_open_file_limit()
    sent_at, latencies, stalled = aio.run(_follow(url, job_ids, opened, failed, published_all))
    results.put((array("d", sent_at).tobytes(), array("d", latencies).tobytes(), stalled))


async def _follow(
    url: str, job_ids: list[str], opened: Any, failed: Any, published_all: EventType
) -> tuple[list[float], list[float], int]:
    sent_at: list[float] = []
    latencies: list[float] = []
    gate = asyncio.Semaphore(OPEN_AT_ONCE)

    async def one(job_id: str) -> None:
        connection = Connection(url)
        try:
            async with gate:
                events = connection.events(f"/v1/jobs/{job_id}/events")
                try:
                    await anext(events)  # the status entry: the stream is open
                except Exception:
                    with failed.get_lock():
                        failed.value += 1
                    raise
            with opened.get_lock():
                opened.value += 1
            async for event in events:
                if event.event == "token":
                    sent = float(json.loads(event.data)["text"])
                    sent_at.append(sent)
                    latencies.append(event.received - sent)
        finally:
            await connection.close()

    followers = [asyncio.create_task(one(job_id)) for job_id in job_ids]
    await asyncio.to_thread(published_all.wait)
    done, pending = await asyncio.wait(followers, timeout=FOLLOW_GRACE_S)
    for task in pending:
        task.cancel()
    ended = sum(1 for task in done if task.exception() is None)
    return sent_at, latencies, len(job_ids) - ended


def _p99_by_second(sent_at: list[float], latencies: list[float], started: float) -> list[float | None]:
    """The relay latency p99 (ms) of the events published in each second of the run: whether delays
    came at the start, periodically or throughout."""
    seconds: dict[int, list[float]] = {}
    for sent, latency in zip(sent_at, latencies, strict=True):
        seconds.setdefault(int(sent - started), []).append(latency)
    return [summary(seconds[second])["p99"] for second in sorted(seconds)]


async def relay_reads(redis_url: str) -> int:
    """XREAD commands Redis has run so far (the relay's: nothing else in this fleet reads streams)."""
    redis = connect(redis_url)
    try:
        return await xread_calls(redis)
    finally:
        await redis.aclose()


async def xread_calls(redis: Redis) -> int:
    """XREAD commands the Redis behind `redis` has run so far (`INFO commandstats`)."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


async def gateway_connections(redis_url: str, gateway_pid: int) -> int:
    """The Redis connections the gateway holds (by the client name it gives them)."""
    redis = connect(redis_url)
    try:
        clients = await redis.client_list()
    finally:
        await redis.aclose()
    return sum(1 for client in clients if client.get("name") == gateway_client_name(gateway_pid))


def publish(redis_url: str, options: CapacityOptions, start: EventType, published: Any) -> None:
    """The stand-in for the workers (a process of its own): token entries at `rate` per stream."""
    start.wait()
    aio.run(_publish(redis_url, options, published))


async def _publish(redis_url: str, options: CapacityOptions, published: Any) -> None:
    # Round robin: event m goes to stream m % streams at began + m / (rate * streams), so every
    # stream gets `rate` events a second with phases spread evenly.
    redis = connect(redis_url)
    queue = JobQueue(redis, 3600, keys)
    streams = options.streams
    ids = _job_ids(streams)
    per_s = options.rate * streams
    began = time.perf_counter()
    count = 0
    while (now := time.perf_counter()) - began < options.duration_s:
        due = int((now - began) * per_s) + 1
        if due > count:
            sent = f"{time.perf_counter():.6f}"
            entries: dict[str, list[dict[str, str]]] = {}
            for m in range(count, due):
                entry = {"type": "token", "text": sent, "ids": "1", "index": str(m // streams)}
                entries.setdefault(ids[m % streams], []).append(entry)
            if options.writer == "step":
                await queue.publish_step(
                    [StepWrite(job_id, 1, added, {}) for job_id, added in entries.items()]
                )
            else:
                async with redis.pipeline(transaction=False) as pipe:
                    for job_id, added in entries.items():
                        for entry in added:
                            pipe.xadd(keys.events(job_id), entry)  # type: ignore[arg-type]
                    notice_streams(pipe, keys, [keys.events(job_id) for job_id in entries])
                    await pipe.execute()
            count = due
        await asyncio.sleep(max(0.0, 0.005 - (time.perf_counter() - now)))
    published.value = count
    async with redis.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.xadd(keys.events(job_id), {"type": "done", "status": "succeeded", "finish_reason": "length"})
        notice_streams(pipe, keys, [keys.events(job_id) for job_id in ids])
        await pipe.execute()
    await redis.aclose()


async def _submissions(options: CapacityOptions, url: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "Hello, how are you today?", "max_tokens": 16}
    latencies: list[float] = []
    left = options.submissions
    bar = tqdm(total=options.submissions, desc="submitting", unit="job", file=sys.stderr, leave=False)

    async def submitter() -> None:
        nonlocal left
        connection = Connection(url)
        try:
            while left > 0:
                left -= 1
                sent = time.perf_counter()
                await connection.json("POST", "/v1/jobs", body, expect=202)
                latencies.append(time.perf_counter() - sent)
                bar.update()
        finally:
            await connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(submitter() for _ in range(options.submit_concurrency)))
    elapsed = time.perf_counter() - started
    bar.close()
    return {
        "submitted": len(latencies),
        "connections": options.submit_concurrency,
        "per_s": round(len(latencies) / elapsed, 1),
        "latency_ms": summary(latencies),
    }


def text(figures: dict[str, Any]) -> str:
    s, sub = figures["streams"], figures["submissions"]
    lat, rss, gc = s["relay_latency_ms"], s["gateway_rss_mb"], s["gc_pauses"]
    rows = [
        ["publisher writes", WRITERS[figures["options"]["writer"]]],
        ["open SSE streams", s["open_streams"]],
        ["streams failed", s["streams_failed"]],
        ["token events relayed / published", f"{s['events_received']} / {s['events_published']}"],
        ["events per second (all streams)", s["events_per_s"]],
        ["relay latency p50 / p99 / max (ms)", f"{lat['p50']} / {lat['p99']} / {lat['max']}"],
        ["gateway CPU while relaying (cores)", s["gateway_cpu_cores"]],
        ["relay reads (XREAD) while relaying", s["relay_reads"]],
        ["gateway RSS idle -> streams open (MB)", f"{rss['idle']} -> {rss['open']}"],
        ["memory per open stream (KB)", s["memory_per_stream_kb"]],
        [
            "gateway Redis connections: streams open / max while relaying",
            f"{s['redis_connections']['streams_open']} / {s['redis_connections']['max_while_relaying']}",
        ],
        [
            "gateway GC while opening: collections (full), over 50 ms, total ms",
            _collections(gc["while_opening"]),
        ],
        [
            "gateway GC while relaying: collections (full), over 50 ms, total ms",
            _collections(gc["while_relaying"]),
        ],
        ["submissions per second", sub["per_s"]],
        ["submission latency p50 / p99 (ms)", f"{sub['latency_ms']['p50']} / {sub['latency_ms']['p99']}"],
    ]
    return table(["gateway", "value"], rows)


def _collections(pauses: dict[str, float]) -> str:
    return (
        f"{pauses['collections']:.0f} ({pauses['full']:.0f}), {pauses['over_50ms']:.0f}, "
        f"{pauses['seconds'] * 1000:.0f}"
    )
