"""Small client helpers the tests share: submit, wait, and read a job's SSE stream."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import aconnect_sse


@dataclass(frozen=True)
class Event:
    id: str
    event: str
    data: dict[str, Any]


async def submit(client: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    reply = await client.post("/v1/jobs", json=body, headers=headers)
    assert reply.status_code == 202, reply.text
    job: dict[str, Any] = reply.json()
    return job


async def wait_done(client: httpx.AsyncClient, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    reply = await client.get(f"/v1/jobs/{job_id}", params={"wait": timeout_s}, timeout=timeout_s + 10)
    assert reply.status_code == 200, reply.text
    job: dict[str, Any] = reply.json()
    assert job["status"] in ("succeeded", "failed", "cancelled"), job
    return job


async def read_events(
    client: httpx.AsyncClient,
    job_id: str,
    *,
    headers: dict[str, str] | None = None,
    connected: asyncio.Event | None = None,
    **params: str,
) -> list[Event]:
    """Every event of the stream up to and including the final done/error event.

    `connected` is set once the stream is open and its first event has arrived.
    """
    events: list[Event] = []
    async with aconnect_sse(
        client, "GET", f"/v1/jobs/{job_id}/events", params=params, headers=headers or {}
    ) as source:
        async for sse in source.aiter_sse():
            events.append(Event(sse.id, sse.event, json.loads(sse.data)))
            if connected is not None:
                connected.set()
            if sse.event in ("done", "error"):
                break
    return events


def streamed_text(events: list[Event]) -> str:
    return "".join(e.data.get("text", "") for e in events if e.event == "token")
