"""Jobs and their SSE streams as a drill sees them: submit, wait, read (reconnecting with
Last-Event-ID across gateways), and check a stream for gaps, duplicates and resumes."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

Entry = tuple[str, dict[str, Any]]  # (stream entry id, event payload)


async def submit(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    reply = await client.post("/v1/jobs", json=body)
    reply.raise_for_status()
    job_id: str = reply.json()["id"]
    return job_id


async def finish(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    """Long-polls until the job ends."""
    while True:
        job: dict[str, Any] = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 30})).json()
        if job["status"] not in ("queued", "running"):
            return job


async def tokens_seen(client: httpx.AsyncClient, job_id: str, tokens: int) -> int:
    """Reads the stream until at least `tokens` tokens arrived; returns how many."""
    seen = 0
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: ") and '"type":"token"' in line:
                seen += len(json.loads(line[6:])["token_ids"])
                if seen >= tokens:
                    return seen
    raise RuntimeError(f"job {job_id} ended before {tokens} tokens")


async def read_once(client: httpx.AsyncClient, job_id: str) -> list[Entry]:
    entries: list[Entry] = []
    async for entry in _entries(client, job_id, None):
        entries.append(entry)
    return entries


async def _entries(client: httpx.AsyncClient, job_id: str, last_id: str | None) -> Any:
    headers = {"Last-Event-ID": last_id} if last_id else {}
    entry_id = ""
    async with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as stream:
        stream.raise_for_status()
        async for line in stream.aiter_lines():
            if line.startswith("id: "):
                entry_id = line[4:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                yield entry_id, data
                if data["type"] in ("done", "error"):
                    return


@dataclass
class Reader:
    """Reads one job's stream to its end through whichever gateway is up, resuming with Last-Event-ID."""

    job_id: str
    gateways: Callable[[], list[str]]  # base URLs of the gateways up now
    entries: list[Entry] = field(default_factory=list)
    reconnects: int = 0

    async def run(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        attempt = 0
        while loop.time() < deadline:
            urls = self.gateways()
            url = urls[attempt % len(urls)] if urls else ""
            attempt += 1
            last = self.entries[-1][0] if self.entries else None
            try:
                async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(10, read=60)) as client:
                    async for entry in _entries(client, self.job_id, last):
                        self.entries.append(entry)
                        if entry[1]["type"] in ("done", "error"):
                            return
            except (httpx.HTTPError, OSError, ValueError):
                pass
            self.reconnects += 1
            await asyncio.sleep(0.1)
        raise TimeoutError(f"job {self.job_id}: its stream did not end within {timeout_s:g} s")


@dataclass(frozen=True)
class StreamCheck:
    text: str
    tokens: int
    gaps: int  # token events that skip tokens
    duplicates: int  # events read twice, or token events that repeat tokens
    resumes: list[Resume]
    final: dict[str, Any]


@dataclass(frozen=True)
class Resume:
    attempt: int
    resumed_from: int  # tokens streamed before the resume
    stall_s: float  # the previous attempt's last token (or its start) -> this attempt's first token
    replay_s: float  # this attempt's start -> its first token (replay of the streamed tokens included)


def check(entries: list[Entry]) -> StreamCheck:
    seen_ids: set[str] = set()
    tokens = gaps = duplicates = 0
    text = ""
    last_token_ms: int | None = None  # or, before the first token, the first attempt's start
    pending: tuple[int, int] | None = None  # a resumed attempt without tokens yet: attempt, start (ms)
    resumes: list[Resume] = []
    for entry_id, data in entries:
        if entry_id in seen_ids:
            duplicates += 1
            continue
        seen_ids.add(entry_id)
        at_ms = int(entry_id.split("-")[0])
        if data["type"] == "status" and data.get("status") == "running":
            if data.get("attempt", 1) > 1:
                pending = (data["attempt"], at_ms)
            last_token_ms = last_token_ms or at_ms
        if data["type"] != "token":
            continue
        index = data["index"]
        if index > tokens:
            gaps += 1
        elif index < tokens:
            duplicates += 1
            continue
        tokens = index + len(data["token_ids"])
        text += data["text"]
        if pending is not None:
            attempt, started_ms = pending
            stall = (at_ms - last_token_ms) / 1000 if last_token_ms is not None else float("nan")
            resumes.append(Resume(attempt, index, stall, (at_ms - started_ms) / 1000))
            pending = None
        last_token_ms = at_ms
    final = entries[-1][1] if entries else {}
    return StreamCheck(text, tokens, gaps, duplicates, resumes, final)


def percentiles(values: list[float]) -> dict[str, float] | None:
    ordered = sorted(v for v in values if v == v)  # NaN: not measured
    if not ordered:
        return None
    return {
        "min": round(ordered[0], 3),
        "p50": round(statistics.median(ordered), 3),
        "p95": round(ordered[max(0, round(0.95 * len(ordered)) - 1)], 3),
        "max": round(ordered[-1], 3),
    }
