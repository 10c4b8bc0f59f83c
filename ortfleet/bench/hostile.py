"""A well-behaved key's success rate and latency while another key attacks the fleet.

`python -m ortfleet.bench.hostile [--duration S] [--model DIR] [--attack KIND] [--json FILE]` starts a
local fleet (redis-server, a gateway with two keys, one worker on the tiny model unless `--model` is
given). The hostile key and anonymous clients then run, at once and for the whole duration:
- `connections`: slowloris connections (partial heads and partial bodies), 1 MB request heads, deeply
  nested and huge-number bodies, lone surrogates in message content, and a flood of event streams;
- `formats`: `--rows` (4) chats at a time whose structured output costs most to close: a string
  `--pattern` (`^[~|]{300}$`) of characters the closing walk tries late, `max_tokens` `--format-tokens`
  (340);
- `all` (the default) both, `none` neither (the well-behaved key's latency alone, to compare).
The well-behaved key meanwhile sends chat completions of `--good-tokens` (8) tokens one after another;
its success rate and latency percentiles are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ortfleet.bench.stats import summary
from ortfleet.fleet.launcher import throwaway_fleet

MODEL = "tiny"
ATTACKS = ("all", "connections", "formats", "none")
BAD_BODIES = [
    "[" * 100_000,
    '{"a":' * 100_000,
    '{"model": "tiny", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}",
    '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
]


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    attacks: dict[str, int] = field(default_factory=dict)

    def fail(self, what: str) -> None:
        self.failures[what] = self.failures.get(what, 0) + 1

    def attacked(self, what: str) -> None:
        self.attacks[what] = self.attacks.get(what, 0) + 1


def create_key(path: Path, name: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "ortfleet", "keys", "create", name, "--file", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip().splitlines()[-1]


async def well_behaved(url: str, token: str, until: float, tally: Tally, tokens: int) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": tokens}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        while time.monotonic() < until:
            started = time.perf_counter()
            try:
                reply = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as e:
                tally.fail(type(e).__name__)
                continue
            if reply.status_code == 200:
                tally.latencies.append(time.perf_counter() - started)
            else:
                tally.fail(str(reply.status_code))


async def slowloris(host: str, port: int, until: float, tally: Tally, partial: bytes) -> None:
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(partial)
            while time.monotonic() < until:  # a byte now and then, until the gateway gives up
                writer.write(b"a")
                await writer.drain()
                if await asyncio.wait_for(reader.read(1), 2.0) == b"":
                    break
        except (OSError, TimeoutError):
            pass
        else:
            writer.close()
        tally.attacked("slowloris")


async def huge_heads(host: str, port: int, until: float, tally: Tally) -> None:
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_048_576 + b"\r\n\r\n")
            await writer.drain()
            await reader.read()
            writer.close()
        except OSError:
            pass
        tally.attacked("huge_head")


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
    headers = {"Authorization": f"Bearer {token}"}
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": plan.pattern}},
        "required": ["s"],
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Fill the pattern."}],
        "max_tokens": plan.format_tokens,
        "response_format": {"type": "json_schema", "json_schema": {"name": "costly", "schema": schema}},
    }

    async def one_row(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            try:
                reply = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                tally.attacked("format_error")
                continue
            tally.attacked("format" if reply.status_code == 200 else f"format_{reply.status_code}")

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        await asyncio.gather(*(one_row(client) for _ in range(plan.rows)))


@dataclass
class Attack:
    kind: str = "all"
    pattern: str = "^[~|]{300}$"
    rows: int = 4
    format_tokens: int = 340
    good_tokens: int = 8


async def attack(
    url: str, tokens: dict[str, str], duration_s: float, hostile_job: str, plan: Attack
) -> Tally:
    host, port = url.removeprefix("http://").split(":")
    until = time.monotonic() + duration_s
    tally = Tally()
    partial_head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "
    partial_body = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"
    attacks: list[Coroutine[Any, Any, None]] = []
    if plan.kind in ("all", "connections"):
        attacks += [
            *(slowloris(host, int(port), until, tally, partial_head) for _ in range(50)),
            *(slowloris(host, int(port), until, tally, partial_body) for _ in range(50)),
            huge_heads(host, int(port), until, tally),
            bad_bodies(url, tokens["hostile"], until, tally),
            stream_flood(url, tokens["hostile"], until, tally, hostile_job),
        ]
    if plan.kind in ("all", "formats"):
        attacks.append(costly_formats(url, tokens["hostile"], until, tally, plan))
    await asyncio.gather(well_behaved(url, tokens["good"], until, tally, plan.good_tokens), *attacks)
    return tally


def run(duration_s: float, model: Path | None, plan: Attack | None = None) -> dict[str, Any]:
    plan = plan or Attack()
    work = Path(tempfile.mkdtemp(prefix="ortfleet-hostile-"))
    if model is None:
        from ortfleet.modelbuild.tiny import build_tiny_model

        model = build_tiny_model(work / "tiny")
    key_file = work / "keys.json"
    tokens = {who: create_key(key_file, who) for who in ("good", "hostile")}
    env = {
        "ORTFLEET_API_KEYS_FILE": str(key_file),
        "ORTFLEET_HEADER_TIMEOUT_S": "2",
        "ORTFLEET_BODY_TIMEOUT_S": "2",
    }
    with throwaway_fleet(env) as fleet:
        _, url = fleet.start_gateway()
        fleet.start_worker(MODEL, model=model, wait=False)
        fleet.wait_workers(MODEL, 1)
        hostile = {"Authorization": f"Bearer {tokens['hostile']}"}
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
        job = httpx.post(f"{url}/v1/jobs", json=body, headers=hostile, timeout=10).json()["id"]
        tally = asyncio.run(attack(url, tokens, duration_s, job, plan))
    done = len(tally.latencies)
    total = done + sum(tally.failures.values())
    return {
        "duration_s": duration_s,
        "attack": plan.kind,
        "pattern": plan.pattern if plan.kind in ("all", "formats") else None,
        "well_behaved": {
            "requests": total,
            "succeeded": done,
            "success_rate": round(done / total, 4) if total else None,
            "failures": tally.failures,
            "latency_ms": summary(tally.latencies),
        },
        "attacks": tally.attacks,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ortfleet.bench.hostile", description=__doc__)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of attack (default 20)")
    parser.add_argument("--model", type=Path, help="model folder (default: a tiny model built now)")
    parser.add_argument("--attack", choices=ATTACKS, default="all", help="which attacks run (default all)")
    parser.add_argument("--pattern", default=Attack.pattern, help="the costly formats' string pattern")
    parser.add_argument("--rows", type=int, default=Attack.rows, help="costly-format chats at a time (4)")
    parser.add_argument("--format-tokens", type=int, default=340, help="max_tokens of the costly formats")
    parser.add_argument("--good-tokens", type=int, default=8, help="max_tokens of the well-behaved chats")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    plan = Attack(args.attack, args.pattern, args.rows, args.format_tokens, args.good_tokens)
    result = run(args.duration, args.model, plan)
    good = result["well_behaved"]
    latency = good["latency_ms"]
    print(
        f"well-behaved key: {good['succeeded']}/{good['requests']} succeeded "
        f"({(good['success_rate'] or 0) * 100:.1f} %), latency p50 {latency['p50']} ms, "
        f"p99 {latency['p99']} ms, during {result['duration_s']:g} s of attacks {result['attacks']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
