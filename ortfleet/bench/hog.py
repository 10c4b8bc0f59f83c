"""`ortfleet bench hog`: one key sends enough long work to hold every row of a worker; another key then
sends short chats, one after another. Is every short chat served, and how soon?

A local fleet with API keys (Redis, a gateway, one worker of --rows rows on the model). The hog key
sends --long chats of about --long-words words at once, each with --choices choices (`n`: one job
each) of --long-max-tokens tokens: long prompts, or more jobs than rows; --delay seconds later the
other key streams --short chats one after another, each for --max-tokens tokens. For each short chat:
its status, its text, its time to first token and its total time; for each long one: its status,
prompt tokens, total time and the times its jobs were preempted (for the other key's chats:
ORTFLEET_PREEMPT_FOR_KEYS).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from ortfleet.bench.hostile import create_key
from ortfleet.bench.prefix import WORDS
from ortfleet.bench.report import figures_header, table
from ortfleet.bench.serving import LOCAL_NAME
from ortfleet.bench.stats import summary
from ortfleet.fleet.launcher import serving_fleet

JOB_ID_HEADER = "X-Ortfleet-Job-Id"
TTFT_GOAL_S = 3.0


@dataclass(frozen=True)
class HogOptions:
    model_dir: Path
    rows: int
    long_requests: int
    long_words: int
    short_requests: int
    max_tokens: int
    delay_s: float
    command_line: str
    choices: int = 1  # n of each long chat
    long_max_tokens: int | None = None  # of each long chat's choices; None: max_tokens


def run(options: HogOptions) -> dict[str, Any]:
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ortfleet-hog-") as folder:
        key_file = Path(folder) / "keys.json"
        hog, other = create_key(key_file, "hog"), create_key(key_file, "other")
        with serving_fleet(
            options.model_dir,
            LOCAL_NAME,
            env={"ORTFLEET_API_KEYS_FILE": str(key_file)},
            worker_args=("--max-batch-size", str(options.rows)),
        ) as url:
            measured = asyncio.run(_measure(options, url, hog, other))
    figures = figures_header(
        "hog",
        options.command_line,
        load_at_start,
        options.model_dir,
        {
            "rows": options.rows,
            "long_requests": options.long_requests,
            "long_words": options.long_words,
            "short_requests": options.short_requests,
            "max_tokens": options.max_tokens,
            "choices": options.choices,
            "long_max_tokens": options.long_max_tokens or options.max_tokens,
            "delay_s": options.delay_s,
        },
    )
    figures |= measured
    figures["goals"] = goals(figures)
    return figures


async def _measure(options: HogOptions, url: str, hog: str, other: str) -> dict[str, Any]:
    async with (
        httpx.AsyncClient(base_url=url, headers=_bearer(hog), timeout=3600) as hog_client,
        httpx.AsyncClient(base_url=url, headers=_bearer(other), timeout=3600) as other_client,
    ):
        longs = [asyncio.create_task(_long(hog_client, options, i)) for i in range(options.long_requests)]
        await asyncio.sleep(options.delay_s)
        shorts = []
        with tqdm(total=options.short_requests, desc="short chats", file=sys.stderr, leave=False) as bar:
            for k in range(options.short_requests):
                shorts.append(await _short(other_client, options, k))
                bar.update()
        long_results = await asyncio.gather(*longs)
        for result in long_results:  # how often its jobs were sent back for the other key's chats
            jobs = [(await hog_client.get(f"/v1/jobs/{job_id}")).json() for job_id in result.pop("job_ids")]
            result["job_preemptions"] = [job.get("preemptions", 0) for job in jobs]
            result["preemptions"] = sum(result["job_preemptions"])
    ttfts = [s["ttft_s"] for s in shorts if s["ttft_s"] is not None]
    return {
        "short": {
            "answered_with_text": sum(1 for s in shorts if s["status"] == 200 and s["text"]),
            "ttft_s": summary(ttfts, scale=1.0),
            "total_s": summary([s["total_s"] for s in shorts], scale=1.0),
            "requests": shorts,
        },
        "long": {
            "succeeded": sum(1 for r in long_results if r["status"] == 200),
            "preemptions": sum(r["preemptions"] for r in long_results),
            "most_preemptions_of_a_job": max(
                (n for r in long_results for n in r["job_preemptions"]), default=0
            ),
            "requests": long_results,
        },
    }


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _long(client: httpx.AsyncClient, options: HogOptions, i: int) -> dict[str, Any]:
    words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(options.long_words))
    body = {
        "model": LOCAL_NAME,
        "messages": [{"role": "user", "content": f"Record {i}: {words}\nSummarise the record."}],
        "max_tokens": options.long_max_tokens or options.max_tokens,
        "n": options.choices,
    }
    started = time.perf_counter()
    reply = await client.post("/v1/chat/completions", json=body)
    result: dict[str, Any] = {
        "status": reply.status_code,
        "total_s": round(time.perf_counter() - started, 3),
        "job_ids": [job_id for job_id in reply.headers.get(JOB_ID_HEADER, "").split(",") if job_id],
    }
    if reply.status_code == 200:
        result["prompt_tokens"] = reply.json()["usage"]["prompt_tokens"]
    return result


async def _short(client: httpx.AsyncClient, options: HogOptions, k: int) -> dict[str, Any]:
    body = {
        "model": LOCAL_NAME,
        "messages": [{"role": "user", "content": f"Name a colour ({k})."}],
        "max_tokens": options.max_tokens,
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line.removeprefix("data: ")).get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - started
                text += piece
    return {
        "status": reply.status_code,
        "ttft_s": None if first is None else round(first, 3),
        "total_s": round(time.perf_counter() - started, 3),
        "text": text,
    }


def goals(figures: dict[str, Any]) -> list[dict[str, Any]]:
    short, long = figures["short"], figures["long"]
    count = figures["options"]["short_requests"]
    return [
        {
            "goal": f"every one of the other key's {count} chats answered with text",
            "figure": short["answered_with_text"],
            "pass": short["answered_with_text"] == count,
        },
        {
            "goal": "every long chat of the hog key answered",
            "figure": long["succeeded"],
            "pass": long["succeeded"] == figures["options"]["long_requests"],
        },
        {
            "goal": f"the other key's chats' first token within {TTFT_GOAL_S:g} s",
            "figure": short["ttft_s"]["max"],
            "pass": short["ttft_s"]["max"] is not None and short["ttft_s"]["max"] <= TTFT_GOAL_S,
        },
    ]


def text(figures: dict[str, Any]) -> str:
    short, long = figures["short"], figures["long"]
    rows = [
        ["short", k, r["status"], r["ttft_s"], r["total_s"], repr(r["text"][:40])]
        for k, r in enumerate(short["requests"])
    ]
    rows += [
        ["long", i, r["status"], "", r["total_s"], f"{r.get('prompt_tokens')} prompt tokens, "
         f"jobs preempted {r['job_preemptions']}"]
        for i, r in enumerate(long["requests"])
    ]  # fmt: skip
    options = figures["options"]
    lines = [
        f"one key's {options['long_requests']} long chats (n={options['choices']}, "
        f"{options['long_max_tokens']} tokens), another key's short chats, on a worker of "
        f"{options['rows']} rows",
        table(["kind", "#", "status", "ttft s", "total s", "what"], rows),
        f"short chats: TTFT p50 {short['ttft_s']['p50']} s, max {short['ttft_s']['max']} s",
        f"long chats' jobs: preempted {long['preemptions']} times in all, one job at most "
        f"{long['most_preemptions_of_a_job']} times",
        "goals:",
        *(f"  {'pass' if g['pass'] else 'FAIL'}  {g['goal']} ({g['figure']})" for g in figures["goals"]),
    ]
    return "\n".join(lines)
