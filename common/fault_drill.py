"""`ortfleet drill kills`: kill -9 the worker of a running job again and again and measure the resume.

Each round submits a greedy job to a two-worker fleet, waits until tokens stream, kills the worker
running it, and measures the time from the kill to the first token of the next attempt. It checks
each resumed stream against an uninterrupted run: same text, no gap, no duplicate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from common.bench.local import LocalFleet

if TYPE_CHECKING:
    from common.cli import Subparsers

MODEL_NAME = "drill"


@dataclass(frozen=True)
class Round:
    resume_s: float
    tokens_before_kill: int
    attempts: int
    same_text: bool
    contiguous: bool


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("drill", help="fault drills on a throwaway local fleet")
    drills = parser.add_subparsers(title="drills", metavar="DRILL", required=True)
    kills = drills.add_parser("kills", help="kill -9 a job's worker mid-stream, N times; measure the resume")
    kills.add_argument("--kills", type=int, default=20, help="rounds (default 20)")
    kills.add_argument("--model", type=Path, help="model folder (default: a tiny model built for the drill)")
    kills.add_argument("--max-tokens", type=int, default=300, help="tokens per job (default 300)")
    kills.add_argument("--heartbeat-ttl", type=float, default=5.0, help="workers' ORTFLEET_HEARTBEAT_TTL_S")
    kills.add_argument("--step-delay", type=float, default=0.01, help="workers' ORTFLEET_STEP_DELAY_S")
    kills.add_argument("--json", type=Path, help="write every figure to this file")
    kills.set_defaults(func=run_kills)


def run_kills(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        from common.modelbuild.tiny import build_tiny_model

        model = build_tiny_model(Path(tempfile.mkdtemp(prefix="ortfleet-drill-")) / "tiny")
    env = {"ORTFLEET_HEARTBEAT_TTL_S": str(args.heartbeat_ttl), "ORTFLEET_STEP_DELAY_S": str(args.step_delay)}
    with LocalFleet(env) as fleet:
        fleet.start_gateway()
        workers = [fleet.start_worker(model, MODEL_NAME, ["--device", "cpu"]) for _ in range(2)]
        fleet.wait_workers(MODEL_NAME, 2)
        rounds = asyncio.run(_drill(fleet, model, workers, args))
    summary = _summary(rounds, args)
    _print_table(summary)
    if args.json:
        figures = {"summary": summary, "rounds": [asdict(r) for r in rounds]}
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if summary["all_exact"] else 1


async def _drill(fleet: LocalFleet, model: Path, workers: list[Any], args: argparse.Namespace) -> list[Round]:
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": args.max_tokens}
    by_pid = {w.pid: w for w in workers}
    rounds: list[Round] = []
    async with httpx.AsyncClient(base_url=fleet.url, timeout=120) as client:
        expected = (await _finish(client, await _submit(client, body)))["output"]
        for index in range(args.kills):
            job_id = await _submit(client, body)
            streamed = await _tokens_seen(client, job_id, 20)
            record = (await client.get(f"/v1/jobs/{job_id}")).json()
            pid = int(record["worker"].split("-")[-2])
            victim = by_pid.pop(pid)
            victim.kill()
            killed_at = time.time()
            victim.wait()
            done = await _finish(client, job_id)
            events = await _events(client, job_id)
            rounds.append(_round(events, done, expected, killed_at, streamed))
            replacement = fleet.start_worker(model, MODEL_NAME, ["--device", "cpu"])
            by_pid[replacement.pid] = replacement
            fleet.wait_workers(MODEL_NAME, 2)
            print(f"round {index + 1}/{args.kills}: resumed in {rounds[-1].resume_s:.2f} s", file=sys.stderr)
    return rounds


async def _submit(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    reply = await client.post("/v1/jobs", json=body)
    reply.raise_for_status()
    job_id: str = reply.json()["id"]
    return job_id


async def _finish(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    while True:
        job: dict[str, Any] = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 30})).json()
        if job["status"] not in ("queued", "running"):
            return job


async def _tokens_seen(client: httpx.AsyncClient, job_id: str, tokens: int) -> int:
    seen = 0
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: ") and '"type":"token"' in line:
                seen += len(json.loads(line[6:])["token_ids"])
                if seen >= tokens:
                    return seen
    raise RuntimeError(f"job {job_id} ended before {tokens} tokens")


async def _events(client: httpx.AsyncClient, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    entry_id = ""
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        async for line in stream.aiter_lines():
            if line.startswith("id: "):
                entry_id = line[4:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                events.append((entry_id, data))
                if data["type"] in ("done", "error"):
                    break
    return events


def _round(
    events: list[tuple[str, dict[str, Any]]], done: dict[str, Any], expected: str, killed_at: float, seen: int
) -> Round:
    ids: list[int] = []
    contiguous = True
    text = ""
    resumed_at = None
    second_attempt = False
    for entry_id, data in events:
        if data["type"] == "status" and data.get("attempt") == 2:
            second_attempt = True
        if data["type"] == "token":
            contiguous = contiguous and data["index"] == len(ids)
            ids += data["token_ids"]
            text += data["text"]
            if second_attempt and resumed_at is None:
                resumed_at = int(entry_id.split("-")[0]) / 1000
    return Round(
        resume_s=round((resumed_at or float("nan")) - killed_at, 3),
        tokens_before_kill=seen,
        attempts=done["attempts"],
        same_text=done["output"] == expected == text,
        contiguous=contiguous and len(ids) == done["usage"]["completion_tokens"],
    )


def _summary(rounds: list[Round], args: argparse.Namespace) -> dict[str, Any]:
    times = sorted(r.resume_s for r in rounds)
    return {
        "kills": len(rounds),
        "heartbeat_ttl_s": args.heartbeat_ttl,
        "resume_s": {
            "min": times[0],
            "p50": statistics.median(times),
            "p95": times[max(0, round(0.95 * len(times)) - 1)],
            "max": times[-1],
        },
        "same_text": sum(r.same_text for r in rounds),
        "contiguous": sum(r.contiguous for r in rounds),
        "all_exact": all(r.same_text and r.contiguous and r.attempts == 2 for r in rounds),
    }


def _print_table(summary: dict[str, Any]) -> None:
    resume = summary["resume_s"]
    print(f"worker kills                 {summary['kills']}")
    print(f"heartbeat TTL                {summary['heartbeat_ttl_s']:g} s")
    print(
        f"kill -> first resumed token  min {resume['min']:.2f} s  p50 {resume['p50']:.2f} s  "
        f"p95 {resume['p95']:.2f} s  max {resume['max']:.2f} s"
    )
    print(f"same text as uninterrupted   {summary['same_text']}/{summary['kills']}")
    print(f"no gap, no duplicate         {summary['contiguous']}/{summary['kills']}")
