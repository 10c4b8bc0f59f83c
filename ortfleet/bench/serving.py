"""`ortfleet bench serving`: what a client of the server gets, against the engine alone, in one run.

On one model folder and one fixed list of requests (prompts from backends.PROMPTS, output lengths drawn
from --lengths by random.Random(0), the same list everywhere), every request generating exactly its
max tokens (end of sequence ignored):
- engine alone: one onnxruntime_genai og.Generator per request in this process, greedy, its KV sized to
  the request (max_length = prompt + max tokens), the requests one after another. TTFT is append_tokens
  of the prompt plus the first generate_next_token; ITL the time between later tokens.
- the server at each concurrency: a local throwaway fleet (Redis, a gateway, one worker on the model
  with its default scheduler) or any OpenAI-compatible server at --url (llama.cpp's llama-server,
  vLLM). C closed-loop clients on keep-alive connections, each sending the next request of the list
  when its last one ends, as streamed text completions (POST /v1/completions, stream, temperature 0,
  min_tokens = max_tokens and ignore_eos). TTFT runs from the request's send to its first text chunk;
  ITL is the time between text chunks, spread evenly over the tokens when the final usage chunk counts
  more tokens than chunks arrived (a server that sends several tokens a chunk, a token whose text waits
  for the next one). Tokens/s is every request's tokens over the level's wall time.
- prefill interference: three requests with prompts of about --long-prompt-tokens tokens (a paragraph
  repeated, measured with the server's POST /tokenize where it has one, else ~4 characters a token)
  and 16 tokens each are sent at once; 0.5 s later a short chat request (16 tokens) is sent. The short
  one's TTFT shows whether the long prefills hold it up.

The goals are checked against the figures of this same run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common import aio
from ortfleet.bench.backends import PROMPTS
from ortfleet.bench.http import Connection, HttpError, served_model
from ortfleet.bench.machine import describe
from ortfleet.bench.report import table
from ortfleet.bench.stats import summary
from ortfleet.fleet.launcher import serving_fleet

LOCAL_NAME = "bench"
INTERFERENCE_LONG = 3  # long prompts sent at once
INTERFERENCE_TOKENS = 16  # tokens of each request in the interference run
INTERFERENCE_DELAY_S = 0.5  # the short request goes this long after the long ones
CHARS_PER_TOKEN = 4  # the estimate when the server cannot tokenize
SHORT_CHAT = "Hi! What is a good name for a small grey cat? Answer in one sentence."
PARAGRAPH = (
    "The harbour town wakes early. Fishing boats leave before dawn, their engines humming across the "
    "still water, while the bakers on the quay light their ovens and the first buses climb the hill "
    "towards the school. By eight the market square is full of stalls selling bread, cheese, apples and "
    "fresh fish, and the ferry to the islands sounds its horn twice before it casts off. "
)

# Goals, checked against the figures of the same run.
GOAL_SCALING_4 = 1.6  # 4 streams' tokens/s over 1 stream's, at least
GOAL_TTFT_P50 = 1.25  # 1 stream's TTFT p50 over the engine alone's, at most
GOAL_ITL_P50 = 1.1  # 1 stream's ITL p50 over the engine alone's, at most
GOAL_TOKENS_PER_S = 0.95  # 1 stream's tokens/s over the engine alone's, at least
GOAL_SHORT_TTFT_S = 3.0  # the short chat's TTFT during the interference, at most


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


@dataclass(frozen=True)
class ServingOptions:
    model_dir: Path | None  # the engine alone's (and the local fleet's); None: a --url without --model
    concurrency: list[int]
    requests: int  # per concurrency (the engine alone runs the same list once)
    lengths: tuple[int, int]  # output tokens of a request, drawn from MIN..MAX
    long_prompt_tokens: int
    interference: bool
    url: str | None = None  # a running OpenAI-compatible server; None starts a local fleet
    name: str | None = None  # its served model name
    command_line: str = ""


def plan(requests: int, lengths: tuple[int, int]) -> list[Planned]:
    """The fixed list of requests: the same for the engine alone and every concurrency."""
    rng = random.Random(0)
    low, high = lengths
    return [Planned(i, PROMPTS[i % len(PROMPTS)], rng.randint(low, high)) for i in range(requests)]


def level_figures(results: list[Served], wall_s: float, errors: int = 0) -> dict[str, Any]:
    tokens = sum(r.tokens for r in results)
    return {
        "requests": len(results),
        "errors": errors,
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "ttft_ms": summary([r.ttft_s for r in results]),
        "itl_ms": summary([g for r in results for g in r.gaps]),
        "per_request": [r.figures() for r in sorted(results, key=lambda r: r.index)],
    }


def run(options: ServingOptions) -> dict[str, Any]:
    """The engine alone (with a model), then the server at each concurrency and the interference."""
    load_at_start = os.getloadavg()
    planned = plan(options.requests, options.lengths)
    steps = (1 if options.model_dir is not None else 0) + len(options.concurrency) + options.interference
    with tqdm(total=steps, desc="serving", unit="run", file=sys.stderr, leave=False) as bar:
        engine = None
        if options.model_dir is not None:  # before the fleet starts: nothing else runs meanwhile
            bar.set_description("engine alone")
            engine = engine_alone(options.model_dir, planned)
            bar.update()
        if options.url is not None:
            name = options.name or aio.run(served_model(options.url))
            measured = aio.run(_measure_server(options, options.url, name, planned, bar))
        else:
            assert options.model_dir is not None
            with serving_fleet(options.model_dir, LOCAL_NAME) as url:
                name = LOCAL_NAME
                measured = aio.run(_measure_server(options, url, name, planned, bar))
    levels, interference = measured
    figures: dict[str, Any] = {
        "bench": "serving",
        "command_line": options.command_line,
        "machine": describe(),
        "load_average": {"start": list(load_at_start), "end": list(os.getloadavg())},
        "model": str(options.model_dir) if options.model_dir is not None else None,
        "server": options.url or "local ortfleet fleet (started by the bench)",
        "served_name": name,
        "options": {
            "concurrency": options.concurrency,
            "requests": options.requests,
            "lengths": list(options.lengths),
            "long_prompt_tokens": options.long_prompt_tokens,
            "interference": options.interference,
        },
        "requests": [{"index": p.index, "prompt": p.prompt, "max_tokens": p.max_tokens} for p in planned],
        "engine_alone": engine,
        "levels": levels,
        "interference": interference,
    }
    figures["goals"] = goals(figures)
    return figures


# --- the engine alone ---------------------------------------------------------------------------------


def engine_alone(model_dir: Path, planned: list[Planned]) -> dict[str, Any]:
    """One og.Generator per request, one request after another; its KV sized to the request."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    tokenizer = og.Tokenizer(model)

    def one(request: Planned) -> Served:
        ids = np.asarray(tokenizer.encode(request.prompt), dtype=np.int32)
        length = len(ids) + request.max_tokens
        params = og.GeneratorParams(model)  # end of sequence masked: exactly max_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False)
        generator = og.Generator(model, params)
        begun = time.perf_counter()
        generator.append_tokens(ids)
        times = []
        for _ in range(request.max_tokens):
            if generator.is_done():
                break
            generator.generate_next_token()
            times.append(time.perf_counter())
        del generator
        if not times:
            raise RuntimeError(f"request {request.index}: the generator was done before its first token")
        gaps = [b - a for a, b in itertools.pairwise(times)]
        ttft = times[0] - begun
        return Served(request.index, request.max_tokens, begun, ttft, times[-1], len(times), gaps, len(ids))

    one(Planned(-1, PROMPTS[0], 8))  # warm-up: first runs pay for allocations, not measured
    started = time.perf_counter()
    results = [one(request) for request in planned]
    wall = time.perf_counter() - started
    return level_figures(results, wall)


# --- the server over HTTP -----------------------------------------------------------------------------


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
    )


async def closed_loop(
    url: str, model: str, planned: list[Planned], concurrency: int
) -> tuple[list[Served], float]:
    """`concurrency` clients, each sending the next request of the list when its last one ends."""
    next_index = 0
    results: list[Served] = []
    connections = [Connection(url) for _ in range(concurrency)]

    async def client(connection: Connection) -> None:
        nonlocal next_index
        while next_index < len(planned):
            request = planned[next_index]
            next_index += 1
            results.append(
                await stream(connection, model, request.index, request.max_tokens, prompt=request.prompt)
            )

    started = time.perf_counter()
    try:
        await asyncio.gather(*(client(c) for c in connections))
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


async def long_prompt(connection: Connection, model: str, number: int, target: int) -> tuple[str, int, str]:
    """A prompt of about `target` tokens (a paragraph repeated, after a line of its own so that no two
    share a prefix a server could cache), its token count and where that count came from."""
    head = f"Document {number}. {PROMPTS[number % len(PROMPTS)]}\n\n"
    body = PARAGRAPH * (target * CHARS_PER_TOKEN // len(PARAGRAPH) + 2)

    def cut(chars: int) -> str:
        return head + body[: max(0, chars - len(head))].rstrip()

    text = cut(target * CHARS_PER_TOKEN)
    count = await count_tokens(connection, model, text)
    if count is None:
        return text, len(text) // CHARS_PER_TOKEN, "estimate"
    for _ in range(4):  # scale the length to the measured ratio until within 1%
        if abs(count - target) <= max(1, target // 100):
            break
        chars = int(len(text) * target / count)
        while len(body) < chars:
            body += PARAGRAPH
        text = cut(chars)
        count = await count_tokens(connection, model, text) or count
    return text, count, "tokenize"


async def interference(url: str, model: str, target: int) -> dict[str, Any]:
    """Three long prompts at once, then after 0.5 s a short chat request: the TTFT of each."""
    connections = [Connection(url) for _ in range(INTERFERENCE_LONG + 1)]
    try:
        prompts = [await long_prompt(connections[0], model, i, target) for i in range(INTERFERENCE_LONG)]
        await connections[0].close()
        sent = time.perf_counter()
        longs = [
            asyncio.create_task(stream(connection, model, i, INTERFERENCE_TOKENS, prompt=text))
            for i, (connection, (text, _, _)) in enumerate(zip(connections, prompts, strict=False))
        ]
        # uvloop's timers count whole milliseconds from a cached clock, so a sleep may end a little early:
        # sleep again until the delay has passed by perf_counter (a deadline, not an event to wait for)
        while (left := sent + INTERFERENCE_DELAY_S - time.perf_counter()) > 0:  # noqa: ASYNC110
            await asyncio.sleep(left)
        short = await stream(connections[-1], model, INTERFERENCE_LONG, INTERFERENCE_TOKENS, chat=SHORT_CHAT)
        done = await asyncio.gather(*longs)
    finally:
        for connection in connections:
            await connection.close()
    return {
        "long_requests": INTERFERENCE_LONG,
        "max_tokens": INTERFERENCE_TOKENS,
        # the server's usage where it gives one, else the count the prompt was sized by
        "long_prompt_tokens": [
            r.prompt_tokens or count for r, (_, count, _) in zip(done, prompts, strict=True)
        ],
        "long_prompts_sized_by": prompts[0][2],
        "long_ttft_ms": [round(r.ttft_s * 1000, 3) for r in done],
        "long_done_ms": [round((r.end - sent) * 1000, 3) for r in done],
        "long_tokens": [r.tokens for r in done],
        "short_sent_at_ms": round((short.start - sent) * 1000, 3),
        "short_ttft_ms": round(short.ttft_s * 1000, 3),
        "short_done_ms": round((short.end - short.start) * 1000, 3),
        "short_tokens": short.tokens,
    }


async def _measure_server(
    options: ServingOptions, url: str, model: str, planned: list[Planned], bar: tqdm[Any]
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    warm = [Planned(-1 - i, PROMPTS[i], 8) for i in range(2)]
    await closed_loop(url, model, warm, 2)  # first requests pay for allocations and caches: not measured
    levels = []
    for concurrency in options.concurrency:
        bar.set_description(f"c={concurrency}")
        results, wall = await closed_loop(url, model, planned, concurrency)
        levels.append({"concurrency": concurrency, **level_figures(results, wall)})
        bar.update()
    measured = None
    if options.interference:
        bar.set_description("interference")
        measured = await interference(url, model, options.long_prompt_tokens)
        bar.update()
    return levels, measured


# --- goals and the table ------------------------------------------------------------------------------


def goals(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with the figure it checks and whether it passes (None: not measured in this run)."""
    by_concurrency = {level["concurrency"]: level for level in figures["levels"]}
    engine, one, four = figures["engine_alone"], by_concurrency.get(1), by_concurrency.get(4)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a is not None and b else None

    def goal(text: str, value: float | None, bound: float, at_least: bool) -> dict[str, Any]:
        passed = None if value is None else (value >= bound if at_least else value <= bound)
        return {"goal": text, "value": value, "bound": bound, "pass": passed}

    out = []
    if one is not None and four is not None:
        scaling = ratio(four["tokens_per_s"], one["tokens_per_s"])
        out.append(
            goal(f"4 streams' tokens/s >= {GOAL_SCALING_4}x 1 stream's", scaling, GOAL_SCALING_4, True)
        )
    if one is not None and engine is not None:
        out += [
            goal(
                f"1 stream: TTFT p50 <= {GOAL_TTFT_P50}x the engine alone's",
                ratio(one["ttft_ms"]["p50"], engine["ttft_ms"]["p50"]),
                GOAL_TTFT_P50,
                False,
            ),
            goal(
                f"1 stream: ITL p50 <= {GOAL_ITL_P50}x the engine alone's",
                ratio(one["itl_ms"]["p50"], engine["itl_ms"]["p50"]),
                GOAL_ITL_P50,
                False,
            ),
            goal(
                f"1 stream: tokens/s >= {GOAL_TOKENS_PER_S}x the engine alone's",
                ratio(one["tokens_per_s"], engine["tokens_per_s"]),
                GOAL_TOKENS_PER_S,
                True,
            ),
        ]
    if figures["interference"] is not None:
        short_s = figures["interference"]["short_ttft_ms"] / 1000
        out.append(
            goal(
                f"interference: the short chat's first token within {GOAL_SHORT_TTFT_S:g} s",
                round(short_s, 3),
                GOAL_SHORT_TTFT_S,
                False,
            )
        )
    return out


def text(figures: dict[str, Any]) -> str:
    headers = ["run", "streams", "requests", "tokens", "wall s", "tok/s", "TTFT p50", "p95", "ITL p50", "p95"]

    def row(label: str, streams: int, f: dict[str, Any]) -> list[Any]:
        ttft, itl = f["ttft_ms"], f["itl_ms"]
        return [
            label, streams, f["requests"], f["output_tokens"], f["wall_s"], f["tokens_per_s"],
            ttft["p50"], ttft["p95"], itl["p50"], itl["p95"],
        ]  # fmt: skip

    rows = []
    if figures["engine_alone"] is not None:
        rows.append(row("engine alone", 1, figures["engine_alone"]))
    server = "ortfleet" if figures["server"].startswith("local") else "server"
    rows += [row(server, level["concurrency"], level) for level in figures["levels"]]
    low, high = figures["options"]["lengths"]
    parts = [
        f"{Path(figures['model']).name if figures['model'] else figures['served_name']}: "
        f"{figures['options']['requests']} requests of {low}..{high} tokens per run (latencies in ms)",
        table(headers, rows),
    ]
    if (i := figures["interference"]) is not None:
        tokens = round(sum(i["long_prompt_tokens"]) / len(i["long_prompt_tokens"]))
        runs = [["long", t, d] for t, d in zip(i["long_ttft_ms"], i["long_done_ms"], strict=True)]
        parts += [
            "",
            f"prefill interference: {i['long_requests']} prompts of ~{tokens} tokens (sized by "
            f"{i['long_prompts_sized_by']}) at once, a short chat {i['short_sent_at_ms']:.0f} ms "
            f"later, {i['max_tokens']} tokens each:",
            table(
                ["request", "TTFT ms", "done ms"],
                [*runs, ["short chat", i["short_ttft_ms"], i["short_done_ms"]]],
            ),
        ]
    parts += ["", "goals (this run's figures):"]
    for g in figures["goals"]:
        verdict = "n/a" if g["pass"] is None else ("PASS" if g["pass"] else "FAIL")
        value = "-" if g["value"] is None else f"{g['value']:g}"
        parts.append(f"  {verdict:4}  {g['goal']}: {value}")
    if not figures["goals"]:
        parts.append("  none apply (figures only)")
    return "\n".join(parts)


def parse_lengths(text: str) -> tuple[int, int]:
    """MIN:MAX output tokens, 1 <= MIN <= MAX."""
    low, sep, high = text.partition(":")
    try:
        lengths = (int(low), int(high))
    except ValueError:
        lengths = (0, 0)
    if not sep or not 1 <= lengths[0] <= lengths[1]:
        raise ValueError(f"{text!r}: give MIN:MAX tokens, 1 <= MIN <= MAX, e.g. 32:224")
    return lengths
