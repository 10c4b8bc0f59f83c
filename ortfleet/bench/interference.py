"""The serving bench's prefill interference run: long prompts at once, then a short chat, and the
short one's TTFT."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ortfleet.bench.backends import PROMPTS
from ortfleet.bench.completions import CHARS_PER_TOKEN, count_tokens, stream
from ortfleet.bench.http import Connection

INTERFERENCE_LONG = 3  # long prompts sent at once
INTERFERENCE_TOKENS = 16  # tokens of each request in the interference run
INTERFERENCE_DELAY_S = 0.5  # the short request goes this long after the long ones
SHORT_CHAT = "Hi! What is a good name for a small grey cat? Answer in one sentence."
PARAGRAPH = (
    "The harbour town wakes early. Fishing boats leave before dawn, their engines humming across the "
    "still water, while the bakers on the quay light their ovens and the first buses climb the hill "
    "towards the school. By eight the market square is full of stalls selling bread, cheese, apples and "
    "fresh fish, and the ferry to the islands sounds its horn twice before it casts off. "
)


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
