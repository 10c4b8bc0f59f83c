"""Streamed OpenAI completions timed on the client's clock: one request (`stream`), closed-loop clients
(`closed_loop`) and the figures of a set of requests, for the benches that measure a server as its
clients see it (serving, prefix)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ortfleet.bench.http import Connection, HttpError
from ortfleet.bench.stats import summary
from ortfleet.bench.steady import steady_state

CHARS_PER_TOKEN = 4  # the estimate when the server cannot tokenize


@dataclass(frozen=True)
class Planned:
    index: int
    prompt: str
    max_tokens: int


@dataclass
class Served:
    """One request's outcome, from its client's clock."""

    index: int
    max_tokens: int
    start: float
    ttft_s: float
    end: float
    tokens: int
    gaps: list[float] = field(default_factory=list)  # seconds between tokens after the first
    prompt_tokens: int | None = None  # the server's usage, if it gave one
    text: str = ""
    cached_tokens: int | None = None  # the server's usage.prompt_tokens_details, if it gave one
    arrivals: list[float] = field(default_factory=list)  # when each text chunk came (one per token at most)
    stream: int = 0  # the closed-loop client that sent it
    model: str = ""  # the `model` it named

    def figures(self) -> dict[str, Any]:
        duration = self.end - self.start
        itl_mean = (self.end - self.start - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None
        return {
            "index": self.index,
            "max_tokens": self.max_tokens,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "ttft_ms": round(self.ttft_s * 1000, 3),
            "itl_mean_ms": round(itl_mean * 1000, 3) if itl_mean is not None else None,
            "tokens_per_s": round(self.tokens / duration, 2) if duration > 0 else None,
            "duration_s": round(duration, 4),
        }


def level_figures(results: list[Served], wall_s: float, errors: int = 0) -> dict[str, Any]:
    """A level's figures: tokens over the wall time (the first request's send to the last one's end)
    beside the steady window's tokens a second (steady.steady_state), TTFT and ITL, and each request's."""
    tokens = sum(r.tokens for r in results)
    started = min((r.start for r in results), default=0.0)
    return {
        "requests": len(results),
        "errors": errors,
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        **steady_state(((r.stream, r.arrivals, r.tokens) for r in results), started, wall_s),
        "ttft_ms": summary([r.ttft_s for r in results]),
        "itl_ms": summary([g for r in results for g in r.gaps]),
        "per_request": [r.figures() for r in sorted(results, key=lambda r: r.index)],
    }


async def stream(
    connection: Connection,
    model: str,
    index: int,
    max_tokens: int,
    prompt: str | None = None,
    chat: str | list[dict[str, str]] | None = None,
) -> Served:
    """One streamed request, a text completion (`prompt`) or a chat completion (`chat`: the user's
    message, or the whole conversation), greedy and exactly `max_tokens` long, timed from its send to
    each text chunk."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,  # vLLM's (and ortfleet's)
        "ignore_eos": True,  # llama.cpp's (vLLM's and ortfleet's too)
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat is not None:
        messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else chat
        path, body["messages"] = "/v1/chat/completions", messages
    else:
        path, body["prompt"] = "/v1/completions", prompt
    start = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    async for event in connection.events(path, body):
        if event.data == "[DONE]":
            continue  # the body's end follows: read it, so the connection can take the next request
        chunk = json.loads(event.data)
        if "error" in chunk:
            raise RuntimeError(f"request {index} failed: {event.data[:500]}")
        for choice in chunk.get("choices") or []:
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text or (choice.get("finish_reason") and not arrivals):  # no text at all: its end counts
                arrivals.append(event.received)
            pieces.append(text or "")
        if chunk.get("usage"):
            usage = chunk["usage"]
    end = time.perf_counter()
    if not arrivals:
        raise RuntimeError(f"request {index} produced no token")
    tokens = int(usage["completion_tokens"]) if usage else len(arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    if tokens > len(arrivals) > 1:  # chunks of several tokens: each gap spread over the tokens it held
        gaps = [g * (len(arrivals) - 1) / (tokens - 1) for g in gaps]
    prompt_tokens = int(usage["prompt_tokens"]) if usage and usage.get("prompt_tokens") else None
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return Served(
        index,
        max_tokens,
        start,
        arrivals[0] - start,
        end,
        tokens,
        gaps,
        prompt_tokens,
        "".join(pieces),
        cached,
        arrivals,
        model=model,
    )


async def closed_loop(
    url: str, model: str | Sequence[str], planned: list[Planned], concurrency: int, first_stream: int = 0
) -> tuple[list[Served], float]:
    """`concurrency` clients, each sending the next request of the list when its last one ends; each
    request names its client (Served.stream: first_stream, first_stream + 1, ...). `model` is every
    client's, or a list: client i's is its i-th, modulo its length."""
    models = [model] if isinstance(model, str) else list(model)
    next_index = 0
    results: list[Served] = []
    connections = [Connection(url) for _ in range(concurrency)]

    async def client(connection: Connection, number: int, model: str) -> None:
        nonlocal next_index
        while next_index < len(planned):
            request = planned[next_index]
            next_index += 1
            served = await stream(connection, model, request.index, request.max_tokens, prompt=request.prompt)
            served.stream = number
            results.append(served)

    started = time.perf_counter()
    try:
        await asyncio.gather(
            *(client(c, first_stream + i, models[i % len(models)]) for i, c in enumerate(connections))
        )
        wall = time.perf_counter() - started
    finally:
        for connection in connections:
            await connection.close()
    return results, wall


async def count_tokens(connection: Connection, model: str, text: str) -> int | None:
    """The server's token count of `text` (vLLM's and ortfleet's POST /tokenize, llama.cpp's with
    `content`), or None where it has none."""
    try:
        reply = await connection.json("POST", "/tokenize", {"model": model, "prompt": text, "content": text})
    except (HttpError, ConnectionError, ValueError):
        await connection.close()
        return None
    if isinstance(reply, dict):
        if isinstance(reply.get("count"), int):
            return int(reply["count"])
        if isinstance(reply.get("tokens"), list):
            return len(reply["tokens"])
    return None
