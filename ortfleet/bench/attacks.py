"""The hostile key's attacks on a fleet, each until a moment on the monotonic clock, and what they
counted (`ortfleet bench hostile`, ortfleet/bench/hostile.py, runs them beside a well-behaved key)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ortfleet.bench.completions import Served
from ortfleet.bench.prefix import WORDS
from ortfleet.bench.stats import summary

MODEL = "tiny"
BAD_BODIES = [
    "[" * 100_000,
    '{"a":' * 100_000,
    '{"model": "tiny", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}",
    '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
]
FLOOD_WORDS = 50  # with the default model's chat template and the note before them, about 90 prompt tokens
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Attack:
    kind: str = "all"
    pattern: str = "^[~|]{300}$"
    rows: int = 4
    format_tokens: int = 340
    good_tokens: int = 20
    flood_threads: int = 4
    alone_s: float = 10.0
    rate: float = 8.0

    def runs(self, attack: str) -> bool:
        return self.kind in (attack, "all")


def count(counts: dict[str, int], what: str) -> None:
    counts[what] = counts.get(what, 0) + 1


@dataclass
class Flood:
    """The flooding key's chats over one phase: those answered, their tokens, the rest by outcome."""

    answered: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        def per_s(n: int) -> float | None:
            return round(n / self.wall_s, 2) if self.wall_s > 0 else None

        return {
            "requests": self.answered,
            "failures": self.failures,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_mean": round(self.prompt_tokens / self.answered, 1) if self.answered else None,
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": per_s(self.answered),
            "tokens_per_s": per_s(self.prompt_tokens + self.completion_tokens),
        }


@dataclass
class Refusals:
    """The refused-format requests: each one's outcome (`400 max_tokens_too_small`) and latency."""

    outcomes: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def figures(self, rate: float) -> dict[str, Any]:
        sent = sum(self.outcomes.values())
        return {
            "target_rate_per_s": rate,
            "sent": sent,
            "rate_per_s": round(sent / self.wall_s, 2) if self.wall_s > 0 else None,
            "refused_max_tokens_too_small": self.outcomes.get("400 max_tokens_too_small", 0),
            "outcomes": self.outcomes,
            "latency_ms": summary(self.latencies),
        }


@dataclass
class Tally:
    served: list[Served] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    attacks: dict[str, int] = field(default_factory=dict)
    flood: dict[str, Flood] = field(default_factory=dict)  # "alone", "contended"
    refusals: Refusals = field(default_factory=Refusals)

    def fail(self, what: str) -> None:
        count(self.failures, what)

    def attacked(self, what: str) -> None:
        count(self.attacks, what)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def attacker_client(url: str, token: str, connections: int | None = None) -> httpx.AsyncClient:
    """The attacking key's client, with `connections` at most (None: httpx's limits)."""
    limits: dict[str, Any] = (
        {} if connections is None else {"limits": httpx.Limits(max_connections=connections)}
    )
    return httpx.AsyncClient(base_url=url, headers=bearer(token), timeout=REQUEST_TIMEOUT_S, **limits)


def pattern_chat(pattern: str, *, key: str, content: str, max_tokens: int, name: str) -> dict[str, Any]:
    """A chat whose json_schema is an object of one required string, `key`, matching `pattern`."""
    schema = {
        "type": "object",
        "properties": {key: {"type": "string", "pattern": pattern}},
        "required": [key],
    }
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    }


Talk = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def connection_attack(host: str, port: int, until: float, tally: Tally, what: str, talk: Talk) -> None:
    """Connections one after another, each held by `talk` and then closed, each counted as `what`."""
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            await talk(reader, writer)
        except (OSError, TimeoutError):
            pass
        else:
            writer.close()
        tally.attacked(what)


async def slowloris(host: str, port: int, until: float, tally: Tally, partial: bytes) -> None:
    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(partial)
        while time.monotonic() < until:  # a byte now and then, until the gateway gives up
            writer.write(b"a")
            await writer.drain()
            if await asyncio.wait_for(reader.read(1), 2.0) == b"":
                break

    await connection_attack(host, port, until, tally, "slowloris", talk)


async def huge_heads(host: str, port: int, until: float, tally: Tally) -> None:
    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_048_576 + b"\r\n\r\n")
        await writer.drain()
        await reader.read()

    await connection_attack(host, port, until, tally, "huge_head", talk)


async def bad_bodies(url: str, token: str, until: float, tally: Tally) -> None:
    headers = {"Authorization": f"Bearer {token}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        while time.monotonic() < until:
            for path in ("/v1/jobs", "/v1/chat/completions", "/v1/completions"):
                for body in BAD_BODIES:
                    try:
                        await client.post(path, content=body)
                    except httpx.HTTPError:
                        pass
                    tally.attacked("bad_body")


async def stream_flood(url: str, token: str, until: float, tally: Tally, job_id: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30, limits=limits) as client:
        while time.monotonic() < until:
            opened = []
            for _ in range(64):
                request = client.build_request("GET", f"/v1/jobs/{job_id}/events")
                try:
                    opened.append(await client.send(request, stream=True))
                except httpx.HTTPError:
                    pass
                tally.attacked("stream")
            await asyncio.sleep(1.0)
            for response in opened:
                await response.aclose()


async def costly_formats(url: str, token: str, until: float, tally: Tally, plan: Attack) -> None:
    """`rows` chats at a time whose string pattern costs the closing walk most, each given room for it."""
    body = pattern_chat(
        plan.pattern, key="s", content="Fill the pattern.", max_tokens=plan.format_tokens, name="costly"
    )

    async def one_row(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            try:
                reply = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                tally.attacked("format_error")
                continue
            tally.attacked("format" if reply.status_code == 200 else f"format_{reply.status_code}")

    async with attacker_client(url, token) as client:
        await asyncio.gather(*(one_row(client) for _ in range(plan.rows)))


async def prefill_flood(
    url: str, token: str, until: float, plan: Attack, flood: Flood, phase: int = 0
) -> None:
    """`flood_threads` clients, each sending 1-token chats of about 90 prompt tokens one after another;
    every prompt its own (`phase` keeps one phase's apart from another's), so none reuses a prefix."""
    started = time.monotonic()

    async def thread(number: int) -> None:
        chooser = random.Random(f"{phase}.{number}")
        async with attacker_client(url, token, connections=1) as client:
            sent = 0
            while time.monotonic() < until:
                sent += 1
                words = " ".join(chooser.choice(WORDS) for _ in range(FLOOD_WORDS))
                content = f"Note {phase}.{number}.{sent}: {words}"
                body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
                try:
                    reply = await client.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as e:
                    count(flood.failures, type(e).__name__)
                    continue
                if reply.status_code != 200:
                    count(flood.failures, str(reply.status_code))
                    if reply.status_code == 429:  # past a limit of the key's: wait as the gateway says
                        wait = float(reply.headers.get("Retry-After", "1"))
                        await asyncio.sleep(max(0.0, min(wait, until - time.monotonic())))
                    continue
                usage = reply.json()["usage"]
                flood.answered += 1
                flood.prompt_tokens += usage["prompt_tokens"]
                flood.completion_tokens += usage["completion_tokens"]

    await asyncio.gather(*(thread(n) for n in range(plan.flood_threads)))
    flood.wall_s = time.monotonic() - started


async def refused_formats(url: str, token: str, until: float, plan: Attack, refusals: Refusals) -> None:
    """`rows` clients sending `rate` requests a second in all, each a 1-token chat whose json_schema
    needs more tokens than that: a 400 max_tokens_too_small once the worker has looked at the schema."""
    body = pattern_chat(plan.pattern, key="a", content="go", max_tokens=1, name="x")
    interval = plan.rows / plan.rate  # each client's, its sends spread evenly between the clients'
    started = time.monotonic()

    async def client_loop(number: int, client: httpx.AsyncClient) -> None:
        due = started + interval * number / plan.rows
        while due < until:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            sent = time.perf_counter()
            try:
                reply = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as e:
                count(refusals.outcomes, type(e).__name__)
            else:
                code = reply.json().get("error", {}).get("code") if reply.status_code != 200 else None
                count(refusals.outcomes, f"{reply.status_code} {code}" if code else str(reply.status_code))
                refusals.latencies.append(time.perf_counter() - sent)
            due = max(due + interval, time.monotonic())  # a client behind its schedule sends no backlog

    async with attacker_client(url, token, connections=plan.rows) as client:
        await asyncio.gather(*(client_loop(n, client) for n in range(plan.rows)))
    refusals.wall_s = time.monotonic() - started
