"""ortfleet's continuous batcher (worker/engines/batcher) on real ONNX Runtime inference: admission while a
batch runs, chunked prefill interleaved with decode, cancel within one chunk, the KV budget, and a lone greedy
request identical to og.Generator's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
import pytest

from tests.waiting import until
from worker.engine import Finish, GenerationRequest, GenerationStream
from worker.engines.batcher.engine import BatchingEngine


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    finish: Finish | None = None
    error: str | None = None
    error_code: str | None = None
    rows: list[int] = field(default_factory=list)  # batch rows of each update
    first_token_at: float | None = None
    replay_exact: bool | None = None


async def collect(stream: GenerationStream) -> Collected:
    result = Collected()
    while True:
        update = await stream.updates.get()
        if update.token_ids and result.first_token_at is None:
            result.first_token_at = time.monotonic()
        if update.replay_exact is not None:
            result.replay_exact = update.replay_exact
        result.tokens += update.token_ids
        result.rows.append(update.batch_rows)
        if update.finish is not None:
            result.finish, result.error = update.finish, update.error
            result.error_code = update.error_code.value if update.error_code else None
            return result


@pytest.fixture
async def engine_factory(tiny_model: Path) -> AsyncIterator[type[BatchingEngine]]:
    made: list[BatchingEngine] = []

    class Made(BatchingEngine):
        def __init__(self, model_dir: Path = tiny_model, **options: object) -> None:
            super().__init__(model_dir, **options)  # type: ignore[arg-type]
            made.append(self)

    yield Made
    for engine in made:
        engine.close()


def long_tokens(engine: BatchingEngine, count: int) -> list[int]:
    words = engine.tokenizer.encode("one two three four five six seven eight ")
    return (words * count)[:count]


def lone_generator_tokens(model_dir: Path, prompt: list[int], count: int) -> list[int]:
    model = og.Model(og.Config(str(model_dir)))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + count, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt, np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


# How close og.Generator's two likeliest tokens may be for a batched row to pick the other: a batch's
# matrix products sum in another order than a lone request's, which moves logits by a few hundredths.
NEAR_TIE_LOGITS = 0.25


def assert_same_greedy_tokens_or_a_near_tie(
    model_dir: Path, prompt: list[int], got: list[int], expected: list[int]
) -> None:
    """`got` is og.Generator's `expected`; or it parts from it once, where og.Generator's two likeliest
    next tokens are these two, within NEAR_TIE_LOGITS of each other (the rest then follows the other
    token and is not compared)."""
    parted = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if parted is None:
        assert got == expected
        return
    model = og.Model(og.Config(str(model_dir)))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + parted + 1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt + expected[:parted], np.int32))
    logits = np.asarray(generator.get_logits(), np.float32).reshape(-1)
    first, second = (int(t) for t in np.argsort(logits)[::-1][:2])
    gap = float(logits[first] - logits[second])
    assert {first, second} == {got[parted], expected[parted]} and gap < NEAR_TIE_LOGITS, (
        f"token {parted}: the batch gave {got[parted]}, og.Generator {expected[parted]}; its two likeliest "
        f"are {first} and {second}, {gap:.3f} apart"
    )


async def test_a_lone_greedy_request_gives_og_generators_tokens_and_so_does_each_row_of_a_batch(
    engine_factory: type[BatchingEngine], tiny_model: Path
) -> None:
    engine = engine_factory(prefill_chunk=16)  # prompts of several chunks
    prompts = [engine.tokenizer.encode(text) for text in ("Once upon a time", "1 2 3 4 5 6 7 8 9 " * 6, "Hi")]
    expected = [lone_generator_tokens(tiny_model, prompt, 40) for prompt in prompts]

    [alone] = [await collect(stream) for stream in engine.submit([GenerationRequest(prompts[0], 40)])]
    together = await asyncio.gather(
        *(collect(stream) for stream in engine.submit([GenerationRequest(p, 40) for p in prompts]))
    )

    def upto_eos(tokens: list[int]) -> list[int]:
        ends = [i for i, t in enumerate(tokens) if t in engine.eos_token_ids]
        return tokens[: ends[0]] if ends else tokens

    assert alone.tokens == upto_eos(expected[0]) and alone.tokens
    assert [row.tokens for row in together] == [upto_eos(tokens) for tokens in expected]
    assert max(max(row.rows) for row in together) == 3  # they did share the batch


async def test_a_request_joins_a_running_batch_at_the_next_step(engine_factory: type[BatchingEngine]) -> None:
    engine = engine_factory(step_delay_s=0.005)
    prompt = engine.tokenizer.encode("Once upon a time")
    [long] = engine.submit([GenerationRequest(prompt, 300, min_new_tokens=300)])
    first = await long.updates.get()
    assert first.token_ids  # the long request runs
    steps_before = engine.counters.decode_steps

    [short] = engine.submit([GenerationRequest(prompt, 5, min_new_tokens=5)])
    joined = await collect(short)
    steps_taken = engine.counters.decode_steps - steps_before

    assert joined.finish is Finish.length and len(joined.tokens) == 5
    assert steps_taken < 30  # it ran beside the long one, which has ~300 steps to go
    assert 2 in joined.rows
    engine.cancel(long)
    rest = await collect(long)
    assert rest.finish is Finish.cancelled


async def test_a_capacity_lowered_after_start_bounds_the_rows_that_run_together(
    engine_factory: type[BatchingEngine],
) -> None:
    engine = engine_factory(slots=4)
    engine.capacity = 2  # as the worker does when its warm-up ran fewer rows together
    prompt = engine.tokenizer.encode("Once upon a time")
    streams = engine.submit([GenerationRequest(prompt, 6, min_new_tokens=6) for _ in range(4)])
    done = await asyncio.gather(*(collect(stream) for stream in streams))
    assert all(len(row.tokens) == 6 for row in done)
    assert max(max(row.rows) for row in done) == 2


async def test_a_long_prompt_is_prefilled_in_chunks_between_the_steps_of_the_others(
    engine_factory: type[BatchingEngine],
) -> None:
    engine = engine_factory(prefill_chunk=16, step_delay_s=0.01)
    short_prompt = engine.tokenizer.encode("Hi")
    long_prompt = long_tokens(engine, 400)
    [running] = engine.submit([GenerationRequest(short_prompt, 200, min_new_tokens=200)])
    await running.updates.get()
    steps_before = engine.counters.decode_steps

    [long] = engine.submit([GenerationRequest(long_prompt, 3)])
    done = await collect(long)
    steps_during = engine.counters.decode_steps - steps_before

    assert done.finish is Finish.length and len(done.tokens) == 3
    # 400 tokens in chunks of 16: 25 prefill runs, each followed by a decode step of the running request.
    assert steps_during >= 25 - 1
    engine.cancel(running)
    assert (await collect(running)).finish is Finish.cancelled


async def test_a_short_prompt_is_prefilled_before_the_rest_of_a_long_one(
    engine_factory: type[BatchingEngine],
) -> None:
    engine = engine_factory(prefill_chunk=16, step_delay_s=0.01)
    long_prompt = long_tokens(engine, 480)
    [long] = engine.submit([GenerationRequest(long_prompt, 1)])
    await until(lambda: engine.counters.prefill_runs >= 2, "the long prompt's prefill began", 30)
    [short] = engine.submit([GenerationRequest(engine.tokenizer.encode("Hi"), 1)])
    short_done, long_done = await asyncio.gather(collect(short), collect(long))

    assert short_done.first_token_at is not None and long_done.first_token_at is not None
    assert short_done.first_token_at < long_done.first_token_at


async def test_cancelling_a_prompt_during_its_chunked_prefill_frees_its_slot_within_one_chunk(
    engine_factory: type[BatchingEngine],
) -> None:
    engine = engine_factory(slots=1, prefill_chunk=16, step_delay_s=0.01)
    long_prompt = long_tokens(engine, 480)
    [long] = engine.submit([GenerationRequest(long_prompt, 5)])
    await until(lambda: engine.counters.prefill_runs >= 3, "the long prompt's prefill began", 30)
    [waiting] = engine.submit([GenerationRequest(engine.tokenizer.encode("Hi"), 2)])
    await until(lambda: engine.rows()[0] == 1, "the short request waits for the only slot", 10)
    engine.cancel(long)
    runs_at_cancel = engine.counters.prefill_runs

    cancelled = await collect(long)
    served = await collect(waiting)

    assert cancelled.finish is Finish.cancelled and not cancelled.tokens
    assert served.finish is Finish.length and len(served.tokens) == 2
    # The long prompt ran at most one more chunk after the cancel; the waiting one took the slot.
    assert engine.counters.prefill_runs <= runs_at_cancel + 1 + 1
    assert engine.counters.prefill_tokens < len(long_prompt)


async def test_requests_wait_for_kv_budget_and_one_larger_than_it_fails_naming_it(
    engine_factory: type[BatchingEngine],
) -> None:
    prompt_tokens = 8
    engine = engine_factory(slots=4, kv_budget_tokens=2 * (prompt_tokens + 20))
    prompt = engine.tokenizer.encode("one two three four five six seven")[:prompt_tokens]
    assert len(prompt) == prompt_tokens
    streams = engine.submit([GenerationRequest(prompt, 20, min_new_tokens=20) for _ in range(4)])
    too_big = engine.submit([GenerationRequest(prompt, 200)])

    results = await asyncio.gather(*(collect(stream) for stream in streams))
    refused = await collect(too_big[0])

    assert all(r.finish is Finish.length and len(r.tokens) == 20 for r in results)
    assert max(max(r.rows) for r in results) == 2  # two fit the budget at once, of four slots
    assert engine.kv_tokens_reserved == 0
    assert refused.finish is Finish.error and refused.error_code == "context_length_exceeded"
    assert refused.error is not None and "ORTFLEET_KV_BUDGET_TOKENS" in refused.error


async def test_seeded_sampling_repeats_and_a_replay_continues_exactly(
    engine_factory: type[BatchingEngine],
) -> None:
    engine = engine_factory()
    prompt = engine.tokenizer.encode("Once upon a time")
    sampled = GenerationRequest(prompt, 30, min_new_tokens=30, temperature=0.9, top_p=0.95, seed=7)
    first, again, other = await asyncio.gather(
        *(
            collect(s)
            for s in engine.submit([sampled, sampled, GenerationRequest(prompt, 30, 30, 0.9, 0.95, seed=8)])
        )
    )
    assert first.tokens == again.tokens and len(first.tokens) == 30
    assert other.tokens != first.tokens

    resumed = GenerationRequest(
        prompt,
        18,
        min_new_tokens=18,
        temperature=0.9,
        top_p=0.95,
        seed=7,
        replay_ids=tuple(first.tokens[:12]),
    )
    [tail] = [await collect(s) for s in engine.submit([resumed])]
    assert tail.replay_exact is True
    assert tail.tokens == first.tokens[12:]


async def test_min_tokens_stop_at_eos_and_a_prompt_over_the_context_are_answered(
    engine_factory: type[BatchingEngine],
) -> None:
    engine = engine_factory()
    prompt = engine.tokenizer.encode("Hi")
    long = [prompt[0]] * engine.context_length
    kept, refused = await asyncio.gather(
        *(
            collect(s)
            for s in engine.submit(
                [GenerationRequest(prompt, 50, min_new_tokens=50), GenerationRequest(long, 5)]
            )
        )
    )
    assert len(kept.tokens) == 50 and not set(kept.tokens) & engine.eos_token_ids
    assert refused.finish is Finish.error and refused.error_code == "context_length_exceeded"


async def test_each_token_comes_with_its_logprob_and_the_likeliest_alternatives_when_asked(
    engine_factory: type[BatchingEngine],
) -> None:
    engine = engine_factory()
    prompt = engine.tokenizer.encode("Once upon a time")
    [stream] = engine.submit([GenerationRequest(prompt, 12, min_new_tokens=12, logprobs=3)])
    steps = []
    while True:
        update = await stream.updates.get()
        if update.token_ids:
            assert update.logprobs is not None and len(update.logprobs) == len(update.token_ids)
            steps += list(zip(update.token_ids, update.logprobs, strict=True))
        if update.finish is not None:
            break

    assert len(steps) == 12
    for token, logprobs in steps:  # greedy: the token is the likeliest, its logprob the highest
        assert len(logprobs.top) == 3 and logprobs.top[0] == (token, logprobs.logprob)
        values = [value for _id, value in logprobs.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    [plain] = engine.submit([GenerationRequest(prompt, 2)])
    assert (await plain.updates.get()).logprobs is None


@pytest.mark.default_model
async def test_on_the_default_model_each_row_of_a_batch_gives_og_generators_greedy_tokens_but_at_near_ties(
    engine_factory: type[BatchingEngine], default_model: Path
) -> None:
    engine = engine_factory(default_model, prefill_chunk=64)
    texts = ("The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Hello! " * 40)
    prompts = [engine.tokenizer.encode(text) for text in texts]
    expected = [lone_generator_tokens(default_model, prompt, 48) for prompt in prompts]

    together = await asyncio.gather(
        *(collect(stream) for stream in engine.submit([GenerationRequest(p, 48) for p in prompts]))
    )

    for prompt, row, tokens in zip(prompts, together, expected, strict=True):
        ends = [i for i, t in enumerate(tokens) if t in engine.eos_token_ids]
        assert_same_greedy_tokens_or_a_near_tie(
            default_model, prompt, row.tokens, tokens[: ends[0]] if ends else tokens
        )
    assert max(max(row.rows) for row in together) == len(prompts)
