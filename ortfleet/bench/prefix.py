"""`ortfleet bench prefix`: what prefix reuse saves, on a local fleet or any server at --url, in one run.

- Conversations: --conversations chats, each about a document of about --document-tokens tokens of its
  own (its own words from the first token, so documents share nothing but the chat template's opening).
  Every first turn is sent, one after another; then every second turn (the first turn, its answer and a
  follow-up question), one after another. Each turn is a streamed chat completion of --max-tokens greedy
  tokens. TTFT runs from the send to the first text chunk; the figure is the median second-turn TTFT over
  the median first-turn TTFT.
- Shared system prompt: --users requests, one after another, each a different question after the same
  system prompt of about --system-tokens tokens. The figure is the share of their prompt tokens the
  server reused (usage.prompt_tokens_details.cached_tokens over usage.prompt_tokens): the prefill work
  saved, since a reused token is not prefilled.

On several workers a turn reuses a prefix only when it lands on the worker that holds it (the claim does
not look for it): run it with --workers 1 and with more.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common import aio
from ortfleet.bench.completions import CHARS_PER_TOKEN, Served, count_tokens, stream
from ortfleet.bench.http import Connection, served_model
from ortfleet.bench.report import figures_header, table
from ortfleet.bench.serving import LOCAL_NAME
from ortfleet.fleet.launcher import serving_fleet

GOAL_SECOND_TURN = 0.25  # median second-turn TTFT over the first's, at most
GOAL_SYSTEM_SAVED = 0.8  # share of the shared-system-prompt requests' prompt tokens reused, at least
WORDS = (
    "harbour lighthouse keeper ferry island market baker quay storm lantern rope gull tide anchor "
    "sail chart compass brass window stair beacon shore reef fog bell signal cabin kettle ledger "
    "evening morning winter summer captain child letter bottle message supply boat engine oar net"
).split()
QUESTIONS = [
    "What is a good name for a small grey cat?",
    "How many legs does a spider have?",
    "Name a fruit that is yellow.",
    "What colour is the sky on a clear day?",
    "Suggest a title for a poem about rain.",
    "What do bees make?",
    "Give one word that rhymes with moon.",
    "Which season comes after spring?",
    "What is the opposite of cold?",
    "Name an animal that lives in the sea.",
]


@dataclass(frozen=True)
class PrefixOptions:
    model_dir: Path | None
    workers: int
    conversations: int
    document_tokens: int
    users: int
    system_tokens: int
    max_tokens: int
    url: str | None
    name: str | None
    command_line: str


def run(options: PrefixOptions) -> dict[str, Any]:
    load_at_start = os.getloadavg()
    if options.url is not None:
        name = options.name or aio.run(served_model(options.url))
        measured = aio.run(_measure(options, options.url, name))
    else:
        assert options.model_dir is not None
        with serving_fleet(options.model_dir, LOCAL_NAME, options.workers) as url:
            name = LOCAL_NAME
            measured = aio.run(_measure(options, url, name))
    figures = figures_header(
        "prefix",
        options.command_line,
        load_at_start,
        options.model_dir,
        {
            "workers": options.workers,
            "conversations": options.conversations,
            "document_tokens": options.document_tokens,
            "users": options.users,
            "system_tokens": options.system_tokens,
            "max_tokens": options.max_tokens,
        },
        server=options.url or f"local ortfleet fleet of {options.workers} worker(s) (started by the bench)",
        served_name=name,
    )
    figures |= measured
    figures["goals"] = goals(figures)
    return figures


async def _measure(options: PrefixOptions, url: str, model: str) -> dict[str, Any]:
    connection = Connection(url)
    try:
        steps = 2 * options.conversations + options.users
        with tqdm(total=steps, desc="prefix", unit="request", file=sys.stderr, leave=False) as bar:
            await stream(connection, model, -1, 4, chat="Hello!")  # the first request pays for allocations
            conversations = await _conversations(connection, model, options, bar)
            system = await _shared_system(connection, model, options, bar)
    finally:
        await connection.close()
    return {"conversations": conversations, "shared_system_prompt": system}


async def _text_of(connection: Connection, model: str, target: int, seed: int) -> str:
    """Words of its own (seeded), about `target` tokens by the server's count."""
    chooser = random.Random(seed)
    words = [chooser.choice(WORDS) for _ in range(target)]
    text = f"Record {seed}: " + " ".join(words)
    counted = await count_tokens(connection, model, text)
    tokens = counted or len(text) // CHARS_PER_TOKEN
    return text if tokens <= target else text[: len(text) * target // tokens]


async def _conversations(
    connection: Connection, model: str, options: PrefixOptions, bar: Any
) -> dict[str, Any]:
    firsts: list[list[dict[str, str]]] = []
    for k in range(options.conversations):
        document = await _text_of(connection, model, options.document_tokens, 1000 + k)
        firsts.append(
            [{"role": "user", "content": f"{document}\n\nWhich word comes up most in this record?"}]
        )
    first_turns: list[Served] = []
    for k, messages in enumerate(firsts):
        first_turns.append(await stream(connection, model, k, options.max_tokens, chat=messages))
        bar.update()
    second_turns: list[Served] = []
    for k, (messages, answer) in enumerate(zip(firsts, first_turns, strict=True)):
        follow_up = [
            *messages,
            {"role": "assistant", "content": answer.text},
            {"role": "user", "content": "And which word comes up least?"},
        ]
        second_turns.append(await stream(connection, model, k, options.max_tokens, chat=follow_up))
        bar.update()
    first_ttft = statistics.median(s.ttft_s for s in first_turns)
    second_ttft = statistics.median(s.ttft_s for s in second_turns)
    return {
        "first_turns": [_turn(s) for s in first_turns],
        "second_turns": [_turn(s) for s in second_turns],
        "first_ttft_ms_median": round(first_ttft * 1000, 1),
        "second_ttft_ms_median": round(second_ttft * 1000, 1),
        "second_over_first": round(second_ttft / first_ttft, 4),
    }


async def _shared_system(
    connection: Connection, model: str, options: PrefixOptions, bar: Any
) -> dict[str, Any]:
    system = await _text_of(connection, model, options.system_tokens, 7)
    served: list[Served] = []
    for k in range(options.users):
        question = f"User {k} asks: {QUESTIONS[k % len(QUESTIONS)]}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        served.append(await stream(connection, model, k, options.max_tokens, chat=messages))
        bar.update()
    prompt = sum(s.prompt_tokens or 0 for s in served)
    cached = sum(s.cached_tokens or 0 for s in served)
    return {
        "requests": [_turn(s) for s in served],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "saved": round(cached / prompt, 4) if prompt else None,
        "reported": any(s.cached_tokens is not None for s in served),
        "ttft_ms_median_first_request": round(served[0].ttft_s * 1000, 1),
        "ttft_ms_median_others": round(statistics.median(s.ttft_s for s in served[1:]) * 1000, 1)
        if len(served) > 1
        else None,
    }


def _turn(served: Served) -> dict[str, Any]:
    return {
        "prompt_tokens": served.prompt_tokens,
        "cached_tokens": served.cached_tokens,
        "ttft_ms": round(served.ttft_s * 1000, 1),
        "tokens": served.tokens,
    }


def goals(figures: dict[str, Any]) -> list[dict[str, Any]]:
    conversations, system = figures["conversations"], figures["shared_system_prompt"]
    ratio, saved = conversations["second_over_first"], system["saved"]
    return [
        {
            "goal": f"second turn TTFT median <= {GOAL_SECOND_TURN}x the first's",
            "value": ratio,
            "bound": GOAL_SECOND_TURN,
            "pass": ratio <= GOAL_SECOND_TURN,
        },
        {
            "goal": f"shared system prompt: >= {GOAL_SYSTEM_SAVED:.0%} of prompt tokens reused",
            "value": saved,
            "bound": GOAL_SYSTEM_SAVED,
            "pass": saved is not None and saved >= GOAL_SYSTEM_SAVED,
        },
    ]


def text(figures: dict[str, Any]) -> str:
    conversations, system = figures["conversations"], figures["shared_system_prompt"]
    options = figures["options"]
    rows = [
        [
            f"turn {k + 1}",
            first["prompt_tokens"],
            first["ttft_ms"],
            second["prompt_tokens"],
            second["cached_tokens"],
            second["ttft_ms"],
        ]
        for k, (first, second) in enumerate(
            zip(conversations["first_turns"], conversations["second_turns"], strict=True)
        )
    ]
    lines = [
        f"{figures['served_name']} on {figures['server']}",
        f"{options['conversations']} conversations, documents of ~{options['document_tokens']} tokens:",
        table(["conversation", "1st prompt", "1st TTFT ms", "2nd prompt", "2nd cached", "2nd TTFT ms"], rows),
        f"median TTFT: first turn {conversations['first_ttft_ms_median']} ms, second turn "
        f"{conversations['second_ttft_ms_median']} ms ({conversations['second_over_first']}x)",
        "",
        f"{options['users']} users after one system prompt of ~{options['system_tokens']} tokens: "
        f"{system['cached_tokens']} of {system['prompt_tokens']} prompt tokens reused ({system['saved']}); "
        f"TTFT {system['ttft_ms_median_first_request']} ms first, "
        f"median {system['ttft_ms_median_others']} ms after",
        "",
        "goals (this run's figures):",
    ]
    for goal in figures["goals"]:
        lines.append(f"  {'PASS' if goal['pass'] else 'FAIL'}  {goal['goal']}: {goal['value']}")
    return "\n".join(lines)
