"""A well-behaved key's success rate and latency while another key attacks the fleet.

`ortfleet bench hostile` (or `python -m ortfleet.bench.hostile`) starts a local fleet (redis-server, a
gateway with two keys, one worker on `--model`: the default model for `ortfleet bench hostile`, a tiny
model built now for `python -m ortfleet.bench.hostile`). The well-behaved key sends streamed greedy chats
of exactly `--good-tokens` (20) tokens one after another for `--duration` seconds, while the hostile key
(and anonymous clients) run `--attack`:
- `connections`: slowloris connections (partial heads and partial bodies), 1 MB request heads, deeply
  nested and huge-number bodies, lone surrogates in message content, and a flood of event streams;
- `formats`: `--rows` (4) chats at a time whose structured output costs most to close: a string
  `--pattern` (`^[~|]{300}$`) of characters the closing walk tries late, `max_tokens` `--format-tokens`
  (340);
- `prefill-flood`: `--flood-threads` (4) clients each sending plain 1-token chats of about 90 prompt
  tokens (on the default model's chat template, words of their own so no prefix is reused) one after
  another; the flood first runs alone for `--alone` (10) seconds, so its own requests and tokens a
  second (prompt tokens included) compare alone and beside the well-behaved key;
- `refused-formats`: `--rows` (4) clients sending `--rate` (8) requests a second in all of a 1-token
  chat whose json_schema holds a string of `--pattern`, each refused with 400 `max_tokens_too_small`
  (the cheap `^[a]{300}$` against the costly default, at the same rate);
- `all` (the default) every attack at once, `none` no attack (the well-behaved key alone, to compare).
Printed and written as JSON (`--json FILE`): the well-behaved key's success rate, latency, time to first
token and gap between its tokens (each gap of a chunk of several tokens spread over them), the attacks'
counts, the flood's throughput and the refusals' outcomes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from ortfleet.bench.argument_types import positive
from ortfleet.bench.attacks import (
    MODEL,
    REQUEST_TIMEOUT_S,
    Attack,
    Flood,
    Tally,
    bad_bodies,
    bearer,
    costly_formats,
    huge_heads,
    prefill_flood,
    refused_formats,
    slowloris,
    stream_flood,
)
from ortfleet.bench.completions import stream
from ortfleet.bench.http import Connection, HttpError
from ortfleet.bench.report import figures_header, write_json
from ortfleet.bench.stats import summary
from ortfleet.fleet.launcher import throwaway_fleet

ATTACKS = ("all", "connections", "formats", "prefill-flood", "refused-formats", "none")


def create_key(path: Path, name: str, *extra: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "ortfleet", "keys", "create", name, "--file", str(path), *extra],
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip().splitlines()[-1]


async def well_behaved(url: str, token: str, until: float, tally: Tally, tokens: int) -> None:
    """Streamed greedy chats of exactly `tokens` tokens, one after another, until `until`."""
    connection = Connection(url, bearer(token))
    index = 0
    try:
        while time.monotonic() < until:
            index += 1
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    tally.served.append(await stream(connection, MODEL, index, tokens, chat="Hello"))
            except HttpError as e:
                tally.fail(str(e.status))
            except (ConnectionError, RuntimeError, TimeoutError) as e:  # RuntimeError: an error event
                tally.fail(type(e).__name__)
                await connection.close()
    finally:
        await connection.close()


async def attack(
    url: str, tokens: dict[str, str], duration_s: float, hostile_job: str, plan: Attack
) -> Tally:
    """The flood alone first (when it runs), then the well-behaved key beside the attacks."""
    host, port = url.removeprefix("http://").split(":")
    tally = Tally()
    warm_up = Connection(url, bearer(tokens["good"]))
    try:  # the first chat pays for the worker's allocations
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            await stream(warm_up, MODEL, 0, plan.good_tokens, chat="Hello")
    finally:
        await warm_up.close()
    if plan.runs("prefill-flood") and plan.alone_s > 0:
        alone = tally.flood["alone"] = Flood()
        await prefill_flood(url, tokens["hostile"], time.monotonic() + plan.alone_s, plan, alone)
    until = time.monotonic() + duration_s
    partial_head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "
    partial_body = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"
    attacks: list[Coroutine[Any, Any, None]] = []
    if plan.runs("connections"):
        attacks += [
            *(slowloris(host, int(port), until, tally, partial_head) for _ in range(50)),
            *(slowloris(host, int(port), until, tally, partial_body) for _ in range(50)),
            huge_heads(host, int(port), until, tally),
            bad_bodies(url, tokens["hostile"], until, tally),
            stream_flood(url, tokens["hostile"], until, tally, hostile_job),
        ]
    if plan.runs("formats"):
        attacks.append(costly_formats(url, tokens["hostile"], until, tally, plan))
    if plan.runs("prefill-flood"):
        contended = tally.flood["contended"] = Flood()
        attacks.append(prefill_flood(url, tokens["hostile"], until, plan, contended, phase=1))
    if plan.runs("refused-formats"):
        attacks.append(refused_formats(url, tokens["hostile"], until, plan, tally.refusals))
    await asyncio.gather(well_behaved(url, tokens["good"], until, tally, plan.good_tokens), *attacks)
    return tally


def run(
    duration_s: float, model: Path | None, plan: Attack | None = None, command: str = ""
) -> dict[str, Any]:
    plan = plan or Attack()
    load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="ortfleet-hostile-"))
    if model is None:
        from ortfleet.modelbuild.tiny import build_tiny_model

        model = build_tiny_model(work / "tiny")
    key_file = work / "keys.json"
    # The well-behaved key is the bench's probe: on the tiny model its back-to-back chats would pass the
    # default request rate limit, which measures the gateway's limits rather than the attack.
    tokens = {"good": create_key(key_file, "good", "--requests-per-minute", "1000000")}
    tokens["hostile"] = create_key(key_file, "hostile")
    env = {
        "ORTFLEET_API_KEYS_FILE": str(key_file),
        "ORTFLEET_HEADER_TIMEOUT_S": "2",
        "ORTFLEET_BODY_TIMEOUT_S": "2",
    }
    with throwaway_fleet(env) as fleet:
        _, url = fleet.start_gateway()
        fleet.start_worker(MODEL, model=model, wait=False)
        fleet.wait_workers(MODEL, 1)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
        reply = httpx.post(f"{url}/v1/jobs", json=body, headers=bearer(tokens["hostile"]), timeout=10)
        tally = asyncio.run(attack(url, tokens, duration_s, reply.json()["id"], plan))
    return figures(tally, duration_s, plan, model, command, load_at_start)


def figures(
    tally: Tally,
    duration_s: float,
    plan: Attack,
    model: Path,
    command: str,
    load_at_start: tuple[float, float, float],
) -> dict[str, Any]:
    done = len(tally.served)
    total = done + sum(tally.failures.values())
    formats = plan.runs("formats") or plan.runs("refused-formats")
    return figures_header("hostile", command, load_at_start, model, asdict(plan)) | {
        "duration_s": duration_s,
        "attack": plan.kind,
        "pattern": plan.pattern if formats else None,
        "well_behaved": {
            "requests": total,
            "succeeded": done,
            "success_rate": round(done / total, 4) if total else None,
            "failures": tally.failures,
            "tokens": plan.good_tokens,
            "latency_ms": summary([s.end - s.start for s in tally.served]),
            "ttft_ms": summary([s.ttft_s for s in tally.served]),
            "gap_ms": summary([gap for s in tally.served for gap in s.gaps]),
        },
        "attacks": tally.attacks,
        "flood": {phase: flood.figures() for phase, flood in tally.flood.items()} or None,
        "refused_formats": tally.refusals.figures(plan.rate) if plan.runs("refused-formats") else None,
    }


def text(result: dict[str, Any]) -> str:
    good = result["well_behaved"]
    latency, gap = good["latency_ms"], good["gap_ms"]
    lines = [
        f"well-behaved key: {good['succeeded']}/{good['requests']} {good['tokens']}-token chats succeeded "
        f"({(good['success_rate'] or 0) * 100:.1f} %), latency p50 {latency['p50']} ms, p99 {latency['p99']} "
        f"ms, gap between tokens p50 {gap['p50']} ms, max {gap['max']} ms, during {result['duration_s']:g} s "
        f"of attack {result['attack']} {result['attacks']}"
    ]
    for phase, flood in (result["flood"] or {}).items():
        lines.append(
            f"flooding key, {phase}: {flood['requests']} chats of {flood['prompt_tokens_mean']} prompt "
            f"tokens in {flood['wall_s']:g} s, {flood['requests_per_s']} requests/s, {flood['tokens_per_s']} "
            f"tokens/s, failures {flood['failures']}"
        )
    if (refused := result["refused_formats"]) is not None:
        lines.append(
            f"refused formats ({result['pattern']}): {refused['sent']} sent, {refused['rate_per_s']}/s "
            f"(target {refused['target_rate_per_s']:g}/s), {refused['refused_max_tokens_too_small']} "
            f"refused max_tokens_too_small, latency p50 {refused['latency_ms']['p50']} ms, "
            f"outcomes {refused['outcomes']}"
        )
    return "\n".join(lines)


def above_zero(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser, model_help: str) -> None:
    """The bench's options, for `ortfleet bench hostile` and `python -m ortfleet.bench.hostile`."""
    add = parser.add_argument
    add("--duration", type=above_zero, default=20.0, help="seconds of attack (default 20)")
    add("--model", type=Path, metavar="DIR", help=model_help)
    add("--attack", choices=ATTACKS, default="all", help="the attack; all: every one at once (default all)")
    add("--pattern", help=f"the string pattern of formats and refused-formats (default {Attack.pattern})")
    add("--rows", type=positive, default=4, help="formats' chats, refused-formats' clients (default 4)")
    add("--format-tokens", type=positive, default=340, help="max_tokens of formats' chats (default 340)")
    add("--flood-threads", type=positive, default=4, help="prefill-flood's clients (default 4)")
    add(
        "--alone", type=float, default=10.0, help="seconds of prefill-flood alone first (default 10; 0: none)"
    )
    add("--rate", type=above_zero, default=8.0, help="refused-formats' requests a second, in all (default 8)")
    add("--good-tokens", type=positive, default=20, help="tokens of each well-behaved chat (default 20)")
    add("--json", type=Path, metavar="FILE", help="write the figures to FILE")


def plan_of(args: argparse.Namespace) -> Attack:
    return Attack(
        kind=args.attack,
        pattern=args.pattern or Attack.pattern,
        rows=args.rows,
        format_tokens=args.format_tokens,
        good_tokens=args.good_tokens,
        flood_threads=args.flood_threads,
        alone_s=args.alone,
        rate=args.rate,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ortfleet.bench.hostile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, "model folder (default: a tiny model built now)")
    args = parser.parse_args(argv)
    command = shlex.join(
        ["python", "-m", "ortfleet.bench.hostile", *(sys.argv[1:] if argv is None else argv)]
    )
    result = run(args.duration, args.model, plan_of(args), command)
    print(text(result))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
