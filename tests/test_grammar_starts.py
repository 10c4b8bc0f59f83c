"""What a grammar costs before its first token (worker/engines/batcher/grammar_starts.py): computed once per
engine, off the engine's thread, while the engine goes on stepping the other rows; and the fewest tokens a
document takes, proven by search (fewest_tokens.py), so that only a request that cannot fit is refused."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer

from common.error_codes import ErrorCode
from common.guidance import json_guidance
from tests.test_batcher import collect
from worker.engine import Finish, GenerationRequest, GenerationStream
from worker.engines.batcher import closing
from worker.engines.batcher.closing_walk import Lexer, WalkBudget, closing_tokens
from worker.engines.batcher.engine import BatchingEngine
from worker.engines.batcher.fewest_tokens import fewest_tokens
from worker.engines.batcher.grammar_starts import Vocabulary, grammar_start
from worker.engines.batcher.json_keys import JsonKeys

END = 256
LIST = r"[a-z]+(,[a-z]+)*\."  # `t,t,t,t,t.` by the walk, where `a.` ends it


def costly(count: int = 300) -> tuple[str, str]:
    """A format whose first ending costs the walk most of its budget (issue 68)."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": f"^[~|]{{{count}}}$"}},
        "required": ["a"],
    }
    guidance = json_guidance(schema)
    return guidance.kind, guidance.grammar


@pytest.fixture(scope="module")
def byte_level() -> Vocabulary:
    """A byte-level vocabulary: one token a byte, end of sequence 256."""
    tokenizer = LLTokenizer.from_tiktoken(
        encoder={bytes([i]): i for i in range(256)},
        special_tokens={"<eos>": END},
        pattern=r".",
        eos_token=END,
    )
    return Vocabulary.of(tokenizer, frozenset({END}))


@pytest.mark.unit
def test_the_search_finds_the_shortest_ending_the_walk_misses(byte_level: Vocabulary) -> None:
    matcher = LLMatcher(byte_level.tokenizer, LLMatcher.grammar_from_regex(LIST), log_level=0)
    walked = closing_tokens(matcher, Lexer(), byte_level.byte_tokens)
    assert walked is not None and len(walked) > 2
    fewest = fewest_tokens(matcher, byte_level.token_bytes, frozenset({END}), None, 10, WalkBudget(40_000))
    assert fewest.tokens is not None and len(fewest.tokens) == 2 == fewest.at_least
    assert byte_level.tokenizer.decode_bytes(fewest.tokens) == b"a."
    start = grammar_start(byte_level, "regex", LIST)
    assert start.ending is not None and start.ending.text == b"a." and start.proven_shortest


@pytest.mark.unit
def test_a_search_out_of_budget_proves_only_the_levels_it_finished(byte_level: Vocabulary) -> None:
    kind, grammar = costly()
    matcher = LLMatcher(byte_level.tokenizer, LLMatcher.grammar_from_json_schema(grammar), log_level=0)
    ends = frozenset({END})
    small = fewest_tokens(matcher, byte_level.token_bytes, ends, JsonKeys(), 5, WalkBudget(40_000))
    assert small == (None, 6)  # `{"a":"` takes 6 byte tokens and closes nothing: no document within 5
    tight = fewest_tokens(matcher, byte_level.token_bytes, ends, JsonKeys(), 400, WalkBudget(2_000))
    assert tight.tokens is None and 1 < tight.at_least < 308
    start = grammar_start(byte_level, kind, grammar)
    assert start.ending is not None and len(start.ending.tokens) == 308  # {"a":" 300 characters "}
    assert start.at_least < 308 and not start.proven_shortest  # found, not proven the fewest


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[BatchingEngine]:
    made = BatchingEngine(tiny_model, step_delay_s=0.005)  # 400 tokens take seconds
    yield made
    made.close()


@pytest.fixture
def first_ending_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The walk of a grammar's first ending (the one given START_BUDGET) waits, once, until `release` is
    set; `entered` says it has begun."""
    entered, release = threading.Event(), threading.Event()
    walk = closing.closing_bytes

    def gated(*args: Any, **kwargs: Any) -> bytes | None:
        budget = args[4] if len(args) > 4 else kwargs.get("budget")
        if isinstance(budget, WalkBudget) and budget.left == closing.START_BUDGET and not entered.is_set():
            entered.set()
            release.wait(600)  # longer than any wait of the tests: they release it
        return walk(*args, **kwargs)

    monkeypatch.setattr(closing, "closing_bytes", gated)
    yield entered, release
    release.set()


async def test_the_engine_steps_other_rows_while_a_grammars_first_ending_is_computed(
    engine: BatchingEngine, first_ending_gate: tuple[threading.Event, threading.Event]
) -> None:
    entered, release = first_ending_gate
    prompt = engine.tokenizer.encode("Once upon a time")
    [running] = engine.submit([GenerationRequest(prompt, 400, min_new_tokens=400)])
    assert (await running.updates.get()).token_ids
    guided = GenerationRequest(prompt, 1, guidance=costly())
    [refused] = engine.submit([guided])
    assert await asyncio.to_thread(entered.wait, 120)
    walked_from = engine.counters.decode_steps
    try:
        while engine.counters.decode_steps < walked_from + 5:  # five steps while the ending is walked
            assert (await asyncio.wait_for(running.updates.get(), 60)).token_ids
    finally:
        release.set()
    done = await collect(refused)
    assert done.finish is Finish.error and done.error_code == ErrorCode.max_tokens_too_small, done.error
    engine.cancel(running)
    assert (await collect(running)).finish is Finish.cancelled


async def test_a_grammar_is_started_once_for_every_request_that_asks_for_it(
    engine: BatchingEngine,
) -> None:
    prompt = engine.tokenizer.encode("Go")
    streams = engine.submit([GenerationRequest(prompt, 1, guidance=costly()) for _ in range(6)])
    streams += engine.submit([GenerationRequest(prompt, 1, guidance=costly()) for _ in range(2)])
    results = [await collect(stream) for stream in streams]
    assert {result.error_code for result in results} == {ErrorCode.max_tokens_too_small}
    assert len({result.error for result in results}) == 1  # the same refusal for each
    assert engine.counters.grammar_starts == 1 and engine.counters.grammar_starts_reused == 7


async def test_a_request_cancelled_while_its_grammar_is_started_ends_cancelled(
    engine: BatchingEngine, first_ending_gate: tuple[threading.Event, threading.Event]
) -> None:
    entered, release = first_ending_gate
    prompt = engine.tokenizer.encode("Go")
    stream: GenerationStream
    [stream] = engine.submit([GenerationRequest(prompt, 400, guidance=costly())])
    assert await asyncio.to_thread(entered.wait, 120)
    engine.cancel(stream)
    release.set()
    assert (await collect(stream)).finish is Finish.cancelled
