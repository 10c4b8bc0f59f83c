"""`ortfleet drill kills`: kill -9 the worker of a running job again and again and measure the resume.

Each round submits a greedy job to a two-worker fleet, waits until a random number of tokens has
streamed, kills the worker running it, and measures the time from the kill to the first token of the
next attempt, and how long the new attempt took to replay the streamed tokens. It checks each resumed
stream against an uninterrupted run: same text, no gap, no duplicate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from ortfleet.drill.streams import check, finish, percentiles, read_once, submit, tokens_seen
from ortfleet.fleet.launcher import FleetProcess, LocalFleet, throwaway_fleet

MODEL_NAME = "drill"


@dataclass(frozen=True)
class Round:
    kill_after: int  # tokens the drill waited for before the kill
    resumed_from: int  # tokens streamed when the next attempt resumed
    resume_s: float  # kill -> first resumed token
    replay_s: float  # the resumed attempt's start -> its first token
    attempts: int
    same_text: bool
    contiguous: bool
    replay_exact: bool | None


def drill_model(path: Path | None) -> Path:
    """The model folder to drill: the one given, else the default model (built once, then cached)."""
    if path is not None:
        return path
    from common.settings import FleetSettings
    from ortfleet.modelbuild.default import ensure_default_model

    return ensure_default_model(FleetSettings().model_cache)


def run_kills(args: argparse.Namespace) -> int:
    model = drill_model(args.model)
    env = {
        "ORTFLEET_HEARTBEAT_TTL_S": str(args.heartbeat_ttl),
        "ORTFLEET_STEP_DELAY_S": str(args.step_delay),
        "ORTFLEET_RESUME_MODE": args.resume_mode,
    }
    with throwaway_fleet(env) as fleet:
        fleet.start_gateway()
        workers = [fleet.start_worker(MODEL_NAME, model=model, device="cpu", wait=False) for _ in range(2)]
        fleet.wait_workers(MODEL_NAME, 2)
        rounds = asyncio.run(_drill(fleet, model, workers, args))
    summary = _summary(rounds, args)
    _print_table(summary)
    if args.json:
        figures = {"summary": summary, "rounds": [asdict(r) for r in rounds]}
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if summary["all_exact"] else 1


async def _drill(
    fleet: LocalFleet, model: Path, workers: list[FleetProcess], args: argparse.Namespace
) -> list[Round]:
    body = {"model": MODEL_NAME, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0}
    by_pid = {w.pid: w for w in workers}
    chooser = random.Random(args.seed)
    rounds: list[Round] = []
    async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=120) as client:
        expected = (await finish(client, await submit(client, body)))["output"]
        for index in range(args.kills):
            kill_after = chooser.randint(1, max(1, args.max_tokens * 4 // 5))
            job_id = await submit(client, body)
            await tokens_seen(client, job_id, kill_after)
            record = (await client.get(f"/v1/jobs/{job_id}")).json()
            pid = int(record["worker"].split("-")[-2])
            victim = by_pid.pop(pid)
            victim.process.kill()
            killed_at = time.time()
            victim.process.wait()
            done = await finish(client, job_id)
            rounds.append(_round(await read_once(client, job_id), done, expected, killed_at, kill_after))
            replacement = fleet.start_worker(MODEL_NAME, model=model, device="cpu", wait=False)
            by_pid[replacement.pid] = replacement
            fleet.wait_workers(MODEL_NAME, 2)
            last = rounds[-1]
            print(
                f"round {index + 1}/{args.kills}: killed after {last.resumed_from} tokens, resumed in "
                f"{last.resume_s:.2f} s (replay {last.replay_s:.2f} s), same text: {last.same_text}",
                file=sys.stderr,
            )
    return rounds


def _round(
    entries: list[tuple[str, dict[str, Any]]],
    done: dict[str, Any],
    expected: str,
    killed_at: float,
    kill_after: int,
) -> Round:
    stream = check(entries)
    resume = stream.resumes[0] if stream.resumes else None
    first_resumed_ms = None
    for entry_id, data in entries:
        if data["type"] == "token" and resume is not None and data["index"] >= resume.resumed_from:
            first_resumed_ms = int(entry_id.split("-")[0])
            break
    return Round(
        kill_after=kill_after,
        resumed_from=resume.resumed_from if resume else -1,
        resume_s=round(first_resumed_ms / 1000 - killed_at, 3) if first_resumed_ms else float("nan"),
        replay_s=round(resume.replay_s, 3) if resume else float("nan"),
        attempts=done["attempts"],
        same_text=done["output"] == expected == stream.text,
        contiguous=stream.gaps == stream.duplicates == 0
        and stream.tokens == done["usage"]["completion_tokens"],
        replay_exact=done.get("resume_exact"),
    )


def _summary(rounds: list[Round], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "kills": len(rounds),
        "model": str(args.model or "default"),
        "resume_mode": args.resume_mode,
        "heartbeat_ttl_s": args.heartbeat_ttl,
        "step_delay_s": args.step_delay,
        "resume_s": percentiles([r.resume_s for r in rounds]),
        "replay_s": percentiles([r.replay_s for r in rounds]),
        "replay_ms_per_token": percentiles(
            [1000 * r.replay_s / r.resumed_from for r in rounds if r.resumed_from > 0]
        ),
        "same_text": sum(r.same_text for r in rounds),
        "contiguous": sum(r.contiguous for r in rounds),
        "all_exact": all(r.same_text and r.contiguous and r.attempts == 2 for r in rounds),
    }


def _print_table(summary: dict[str, Any]) -> None:
    def line(figures: dict[str, float] | None, unit: str) -> str:
        if figures is None:
            return "-"
        return "  ".join(f"{k} {v:.2f}{unit}" for k, v in figures.items())

    print(f"worker kills                 {summary['kills']} (resume mode {summary['resume_mode']})")
    print(f"heartbeat TTL                {summary['heartbeat_ttl_s']:g} s")
    print(f"kill -> first resumed token  {line(summary['resume_s'], ' s')}")
    print(f"replay (start -> 1st token)  {line(summary['replay_s'], ' s')}")
    print(f"replay per streamed token    {line(summary['replay_ms_per_token'], ' ms')}")
    print(f"same text as uninterrupted   {summary['same_text']}/{summary['kills']}")
    print(f"no gap, no duplicate         {summary['contiguous']}/{summary['kills']}")
