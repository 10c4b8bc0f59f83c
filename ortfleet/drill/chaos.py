"""`ortfleet drill chaos`: N concurrent jobs while workers are killed, gateways are killed and Redis
restarts, on a schedule spread over a few seconds.

Readers follow every job's stream through whichever gateway is up, resuming with Last-Event-ID. The
drill first runs each distinct prompt once without faults, then reports jobs lost or failed, stream
gaps and duplicates, texts identical to the fault-free run, and how long resumed streams stalled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from ortfleet.drill.kills import drill_model
from ortfleet.drill.streams import Reader, StreamCheck, check, finish, percentiles, submit
from ortfleet.fleet.launcher import FleetProcess, LocalFleet
from ortfleet.fleet.processes import ChildProcess, StartupError, free_port, start_redis, stop, wait_for_port

MODEL_NAME = "chaos"
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Describe a walk through a rainy city at night.",
    "What makes a good cup of tea?",
    "Tell me about the moons of Jupiter.",
    "Write a letter to a friend who moved far away.",
]


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str  # worker_kill, gateway_kill, redis_restart
    detail: str = ""


class Chaos:
    """The fleet under test, and the faults done to it."""

    def __init__(self, fleet: LocalFleet, model: Path, args: argparse.Namespace) -> None:
        self.fleet = fleet
        self.model = model
        self.args = args
        self.gateways: list[tuple[ChildProcess, str]] = []
        self.workers: list[FleetProcess] = []
        self.done: list[Fault] = []
        self.redis_dir = fleet.log_dir / "redis-data"
        self.redis = fleet.start_redis(appendonly=True, data_dir=self.redis_dir)

    def urls(self) -> list[str]:
        return [url for process, url in self.gateways if process.poll() is None]

    def start_gateway(self) -> None:
        """A gateway on a free port, once it listens (slow to start on a loaded machine)."""
        port = free_port()
        try:
            self.fleet.start_gateway(port=port)
        except StartupError:
            wait_for_port(port, self.fleet.gateways[-1].process, "the gateway", timeout_s=120)
        self.gateways.append((self.fleet.gateways[-1].process, f"http://127.0.0.1:{port}"))

    def restart_redis(self) -> None:
        """Stops redis-server cleanly and starts it again on the same port, from its append-only file."""
        port = int(self.redis.url.rsplit(":", 1)[1].split("/")[0])
        stop(self.redis.process)
        self.redis.process = start_redis(port, self.redis_dir, appendonly=True)

    def start_worker(self) -> None:
        batch = ["--max-batch-size", str(self.args.batch_size)]
        self.workers.append(
            self.fleet.start_worker(MODEL_NAME, *batch, model=self.model, device="cpu", wait=False)
        )

    async def run_schedule(
        self, schedule: list[tuple[float, str]], started: float, running: list[str]
    ) -> None:
        """Does the faults on time; a worker kill hits the worker of a job still running if it can."""
        chooser = random.Random(self.args.seed)
        restarts: list[asyncio.Task[None]] = []
        for at_s, kind in schedule:
            await asyncio.sleep(max(0.0, started + at_s - time.monotonic()))
            if kind == "worker_kill":
                victim = await self._victim(chooser, running)
                victim.kill()
                self.start_worker()
                detail = f"pid {victim.pid}"
            elif kind == "gateway_kill":
                process, url = chooser.choice([g for g in self.gateways if g[0].poll() is None])
                process.kill()
                process.wait()
                restarts.append(asyncio.create_task(asyncio.to_thread(self.start_gateway)))
                detail = url
            else:
                await asyncio.to_thread(self.restart_redis)
                detail = self.redis.url
            self.done.append(Fault(round(time.monotonic() - started, 2), kind, detail))
            print(f"{self.done[-1].at_s:6.2f} s  {kind} {detail}", file=sys.stderr)
        await asyncio.gather(*restarts)

    async def _victim(self, chooser: random.Random, running: list[str]) -> FleetProcess:
        """The worker of a running job (looking for one for up to 5 s), else any live worker."""
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self._running_worker(chooser, running), 5)
        return chooser.choice([w for w in self.workers if w.alive()])

    async def _running_worker(self, chooser: random.Random, running: list[str]) -> FleetProcess:
        while True:
            live = {w.pid: w for w in self.workers if w.alive()}
            for url in self.urls()[:1]:
                async with httpx.AsyncClient(base_url=url, timeout=1) as client:
                    for job_id in chooser.sample(running, len(running)):
                        try:
                            job = (await client.get(f"/v1/jobs/{job_id}")).json()
                        except (httpx.HTTPError, ValueError):
                            continue
                        if job.get("status") == "running" and job.get("worker"):
                            pid = int(job["worker"].split("-")[-2])
                            if pid in live:
                                return live[pid]
            await asyncio.sleep(0.5)


def schedule(args: argparse.Namespace) -> list[tuple[float, str]]:
    """Faults at random times within the first `duration` seconds of the run."""
    chooser = random.Random(args.seed)
    kinds = ["worker_kill"] * args.worker_kills + ["gateway_kill"] * args.gateway_kills
    kinds += ["redis_restart"] * args.redis_restarts
    return sorted((round(chooser.uniform(1.0, args.duration), 2), kind) for kind in kinds)


def run_chaos(args: argparse.Namespace) -> int:
    model = drill_model(args.model)
    env = {
        "ORTFLEET_HEARTBEAT_TTL_S": str(args.heartbeat_ttl),
        "ORTFLEET_STEP_DELAY_S": str(args.step_delay),
        "ORTFLEET_RESUME_MODE": args.resume_mode,
    }
    with LocalFleet(env={"ORTFLEET_LOG_LEVEL": "warning", **env}) as fleet:
        chaos = Chaos(fleet, model, args)
        for _ in range(args.gateways):
            chaos.start_gateway()
        for _ in range(args.workers):
            chaos.start_worker()
        fleet.wait_workers(MODEL_NAME, args.workers)
        report = asyncio.run(_chaos(chaos, args))
    _print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["summary"]["all_exact"] else 1


async def _chaos(chaos: Chaos, args: argparse.Namespace) -> dict[str, Any]:
    prompts = PROMPTS[: max(1, min(args.prompts, len(PROMPTS)))]

    def body(prompt: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": prompt}]
        return {"model": MODEL_NAME, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0}

    async with httpx.AsyncClient(base_url=chaos.urls()[0], timeout=120) as client:
        ids = [await submit(client, body(p)) for p in prompts]
        expected = {p: (await finish(client, i))["output"] for p, i in zip(prompts, ids, strict=True)}
        jobs = [
            (await submit(client, body(prompts[n % len(prompts)])), prompts[n % len(prompts)])
            for n in range(args.jobs)
        ]
    started = time.monotonic()
    readers = [Reader(job_id, chaos.urls) for job_id, _ in jobs]
    running = [job_id for job_id, _ in jobs]
    faults = asyncio.create_task(chaos.run_schedule(schedule(args), started, running))
    outcomes = await asyncio.gather(*(r.run(args.timeout) for r in readers), return_exceptions=True)
    await faults
    elapsed = time.monotonic() - started
    records = []
    async with httpx.AsyncClient(base_url=chaos.urls()[0], timeout=120) as client:
        for job_id, _ in jobs:
            records.append(await finish(client, job_id))
    checks = [check(r.entries) for r in readers]
    rows = [
        _job_row(job_id, prompt, record, stream, outcome, expected[prompt], reader.reconnects)
        for (job_id, prompt), record, stream, outcome, reader in zip(
            jobs, records, checks, outcomes, readers, strict=True
        )
    ]
    return {
        "summary": _summary(rows, checks, elapsed, args),
        "faults": [asdict(f) for f in chaos.done],
        "jobs": rows,
    }


def _job_row(
    job_id: str,
    prompt: str,
    record: dict[str, Any],
    stream: StreamCheck,
    outcome: BaseException | None,
    expected: str,
    reconnects: int,
) -> dict[str, Any]:
    return {
        "id": job_id,
        "prompt": prompt,
        "status": record["status"],
        "error": record.get("error"),
        "attempts": record["attempts"],
        "worker_deaths": record.get("worker_deaths", 0),
        "resume_exact": record.get("resume_exact"),
        "stream_ended": outcome is None and stream.final.get("type") in ("done", "error"),
        "gaps": stream.gaps,
        "duplicates": stream.duplicates,
        "identical": stream.text == expected == record.get("output"),
        "reconnects": reconnects,
        "resume_stalls_s": [round(r.stall_s, 3) for r in stream.resumes if r.stall_s == r.stall_s],
        "replay_s": [round(r.replay_s, 3) for r in stream.resumes],
    }


def _summary(
    rows: list[dict[str, Any]], checks: list[StreamCheck], elapsed: float, args: argparse.Namespace
) -> dict[str, Any]:
    lost = sum(1 for r in rows if not r["stream_ended"])
    failed = sum(1 for r in rows if r["status"] != "succeeded")
    identical = sum(1 for r in rows if r["identical"])
    gaps = sum(r["gaps"] for r in rows)
    duplicates = sum(r["duplicates"] for r in rows)
    return {
        "jobs": len(rows),
        "workers": args.workers,
        "batch_size": args.batch_size,
        "max_tokens": args.max_tokens,
        "resume_mode": args.resume_mode,
        "seconds": round(elapsed, 1),
        "lost": lost,
        "failed": failed,
        "gaps": gaps,
        "duplicates": duplicates,
        "identical": identical,
        "resumed_jobs": sum(1 for c in checks if c.resumes),
        "reconnects": sum(r["reconnects"] for r in rows),
        "resume_stall_s": percentiles([s for r in rows for s in r["resume_stalls_s"]]),
        "replay_s": percentiles([s for r in rows for s in r["replay_s"]]),
        "all_exact": lost == failed == gaps == duplicates == 0 and identical == len(rows),
    }


def _print_report(report: dict[str, Any]) -> None:
    s = report["summary"]
    kinds = [f["kind"] for f in report["faults"]]
    print(
        f"faults                     {kinds.count('worker_kill')} worker kills, "
        f"{kinds.count('gateway_kill')} gateway kills, {kinds.count('redis_restart')} Redis restarts"
    )
    print(f"jobs                       {s['jobs']} ({s['workers']} workers, batch {s['batch_size']})")
    print(f"lost / failed              {s['lost']} / {s['failed']}")
    print(f"gaps / duplicates          {s['gaps']} / {s['duplicates']}")
    print(f"identical to fault-free    {s['identical']}/{s['jobs']}")
    print(f"resumed jobs               {s['resumed_jobs']}, reader reconnects {s['reconnects']}")
    for name in ("resume_stall_s", "replay_s"):
        figures = s[name]
        shown = "  ".join(f"{k} {v:.2f} s" for k, v in figures.items()) if figures else "-"
        print(f"{name:<26} {shown}")
    print(f"wall time                  {s['seconds']} s")
