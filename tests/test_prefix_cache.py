"""Prefix reuse in the batcher (worker/engines/batcher/prefix_cache.py): a prompt that starts like one run
before prefills only the rest, whole chunks at a time, and gives the tokens it gives without the cache."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from redis.asyncio import Redis

from common.registry import live_workers
from tests.conftest import keys
from tests.test_batcher import collect, long_tokens
from tests.test_observability import value
from tests.waiting import until
from worker.engine import Finish, GenerationRequest
from worker.engines.batcher.engine import BatchingEngine
from worker.engines.batcher.prefix_cache import PrefixCache, prompt_blocks

CHUNK = 32


def make(made: list[BatchingEngine], model_dir: Path, **options: object) -> BatchingEngine:
    options = {"prefill_chunk": CHUNK, **options}
    engine = BatchingEngine(model_dir, **options)  # type: ignore[arg-type]
    made.append(engine)
    return engine


async def greedy(engine: BatchingEngine, prompt: list[int], count: int = 8) -> list[int]:
    [stream] = engine.submit([GenerationRequest(prompt, count, min_new_tokens=count)])
    result = await collect(stream)
    assert result.finish is Finish.length, result.error
    return result.tokens


def prompts(engine: BatchingEngine) -> tuple[list[int], list[int], list[int]]:
    """A 100-token prompt, the same with 20 more tokens, and one that parts from it at token 70."""
    base = long_tokens(engine, 100)
    follow_up = base + engine.tokenizer.encode(" and then the story went on")[:20]
    parted = base[:70] + [t + 1 for t in base[70:]]
    return base, follow_up, parted


async def test_a_prompt_that_extends_a_cached_one_prefills_only_the_rest_and_gives_the_same_tokens(
    engines: list[BatchingEngine], tiny_model: Path
) -> None:
    cached, plain = make(engines, tiny_model), make(engines, tiny_model, prefix_cache=False)
    base, follow_up, parted = prompts(cached)

    await greedy(cached, base)
    assert cached.prefix_cache_tokens == 96  # whole chunks of the prompt: 3 x 32
    before = cached.counters.prefill_tokens
    assert await greedy(cached, follow_up) == await greedy(plain, follow_up)
    assert cached.counters.prefix_hits == 1 and cached.counters.prefix_tokens_reused == 96
    assert cached.counters.prefill_tokens - before == len(follow_up) - 96

    # a partial hit: the first two whole chunks of the 70 shared tokens
    assert await greedy(cached, parted) == await greedy(plain, parted)
    assert cached.counters.prefix_hits == 2 and cached.counters.prefix_tokens_reused == 96 + 64

    # a miss, and a prompt shorter than a chunk, reuse nothing
    other = [t + 3 for t in base]
    assert await greedy(cached, other) == await greedy(plain, other)
    assert await greedy(cached, base[:20]) == await greedy(plain, base[:20])
    assert cached.counters.prefix_hits == 2
    assert plain.counters.prefix_hits == 0 and plain.prefix_cache_tokens == 0


async def test_a_prompt_one_chunk_long_runs_its_last_token_itself(
    engines: list[BatchingEngine], tiny_model: Path
) -> None:
    cached, plain = make(engines, tiny_model), make(engines, tiny_model, prefix_cache=False)
    prompt = long_tokens(cached, 64)
    first = await greedy(cached, prompt)
    assert await greedy(cached, prompt) == first == await greedy(plain, prompt)
    assert cached.counters.prefix_tokens_reused == 32  # not 64: the prompt's last token is always run


async def test_the_least_recently_used_prefix_is_overwritten_first(
    engines: list[BatchingEngine], tiny_model: Path
) -> None:
    engine = make(engines, tiny_model, slots=2)
    a = long_tokens(engine, 70)
    b = [t + 1 for t in a]
    c = [t + 2 for t in a]
    await greedy(engine, a)
    await greedy(engine, b)
    await greedy(engine, [*a, 5])  # a is used again: b is now the older entry
    assert engine.counters.prefix_hits == 1
    await greedy(engine, c)  # a miss takes b's slot
    await greedy(engine, [*a, 6])
    assert engine.counters.prefix_hits == 2
    await greedy(engine, [*b, 7])
    assert engine.counters.prefix_hits == 2  # b was overwritten


async def test_a_cancelled_prefill_leaves_nothing_to_reuse(
    engines: list[BatchingEngine], tiny_model: Path
) -> None:
    engine = make(engines, tiny_model, step_delay_s=0.05)
    prompt = long_tokens(engine, 400)
    [stream] = engine.submit([GenerationRequest(prompt, 4)])
    await until(lambda: engine.counters.prefill_runs >= 2, "the prefill began", 30)
    engine.cancel(stream)
    assert (await collect(stream)).finish is Finish.cancelled
    assert engine.prefix_cache_tokens == 0
    await greedy(engine, prompt)
    assert engine.counters.prefix_hits == 0


async def test_rows_that_end_in_any_order_keep_their_own_prompts(
    engines: list[BatchingEngine], tiny_model: Path
) -> None:
    cached, plain = make(engines, tiny_model), make(engines, tiny_model, prefix_cache=False)
    firsts = [[t + k for t in long_tokens(cached, 66)] for k in range(4)]
    lengths = [12, 3, 8, 5]  # they end out of order, so the last decode rows move into the gaps
    streams = cached.submit(
        [GenerationRequest(p, n, min_new_tokens=n) for p, n in zip(firsts, lengths, strict=True)]
    )
    await asyncio.gather(*(collect(s) for s in streams))
    assert cached.prefix_cache_tokens == 4 * 64
    for prompt in firsts:
        follow_up = [*prompt, 9, 10, 11]
        assert await greedy(cached, follow_up) == await greedy(plain, follow_up)
    assert cached.counters.prefix_hits == 4 and cached.counters.prefix_tokens_reused == 4 * 64


@pytest.mark.default_model
async def test_on_the_default_model_a_follow_up_turn_reuses_the_first_and_gives_the_same_tokens(
    engines: list[BatchingEngine], default_model: Path
) -> None:
    cached = make(engines, default_model, prefill_chunk=256)
    plain = make(engines, default_model, prefill_chunk=256, prefix_cache=False)
    document = " ".join(
        f"Paragraph {i} tells of a lighthouse keeper and the ships he saw." for i in range(60)
    )
    first = [{"role": "user", "content": f"{document}\n\nSummarize the document in one sentence."}]
    chat = cached.tokenizer.apply_chat_template
    first_ids = cached.tokenizer.encode(chat(json_messages(first)))
    reply = await greedy(cached, first_ids, 24)
    second = [
        *first,
        {"role": "assistant", "content": cached.tokenizer.decode(reply)},
        {"role": "user", "content": "Now name the keeper."},
    ]
    second_ids = cached.tokenizer.encode(chat(json_messages(second)))
    assert await greedy(cached, second_ids, 24) == await greedy(plain, second_ids, 24)
    assert cached.counters.prefix_tokens_reused == len(first_ids) // 256 * 256 > 0


def json_messages(messages: list[dict[str, str]]) -> str:
    import json

    return json.dumps(messages)


@pytest.mark.unit
def test_matches_count_whole_chunks_short_of_the_last_token_and_victims_go_least_recent_first() -> None:
    cache = PrefixCache(4)
    cache.keep(0, list(range(10)), "a")  # 8 tokens kept
    cache.keep(1, [7] * 3, "a")  # shorter than a chunk: nothing
    assert cache.tokens == 8 and cache.length(1) == 0
    assert cache.match(list(range(20)), "a", {0, 1}) == (0, 8)
    assert cache.match(list(range(8)), "a", {0, 1}) == (0, 4)  # the 8th token is the prompt's last
    assert cache.match([*range(6), 99, 99, 99], "a", {0, 1}) == (0, 4)
    assert cache.match(list(range(20)), "a", {1}) == (None, 0)  # slot 0 is not free
    cache.keep(2, [5] * 8, "a")
    assert cache.victim({0, 1, 2}, "a") == 1  # an empty slot first
    cache.match(list(range(20)), "a", {0})  # slot 0 used after slot 2 was kept
    assert cache.victim({0, 2}, "a") == 2
    cache.moved(2, 3)
    assert cache.length(3) == 8 and cache.length(2) == 0
    cache.forget(3)
    cache.clear()
    assert cache.tokens == 0


@pytest.mark.unit
def test_a_prompt_matches_only_prefixes_kept_in_its_own_cache_scope() -> None:
    cache = PrefixCache(4)
    cache.keep(0, list(range(12)), "alice")
    assert cache.match(list(range(20)), "bob", {0}) == (None, 0)
    assert cache.match(list(range(20)), "", {0}) == (None, 0)
    assert cache.match(list(range(20)), "alice", {0}) == (0, 12)
    assert prompt_blocks("alice", range(8), 4)[1] != prompt_blocks("bob", range(8), 4)[1]
    # blocks are chained: a chunk equal to another prompt's matches only after the same chunks
    assert (
        prompt_blocks("alice", [*range(4), 9, 9, 9, 9], 4)[1]
        != prompt_blocks("alice", [0] * 4 + [9] * 4, 4)[1]
    )


@pytest.mark.unit
def test_a_request_without_a_match_evicts_the_largest_scopes_least_recent_prefix() -> None:
    cache = PrefixCache(4)
    cache.keep(0, list(range(8)), "alice")  # alice: 2 blocks, the oldest entry
    cache.keep(1, [5] * 4, "bob")
    cache.keep(2, [6] * 4, "bob")
    cache.keep(3, [7] * 4, "bob")  # bob: 3 blocks
    assert cache.victim({0, 1, 2, 3}, "alice") == 1  # bob holds more: his oldest goes, not alice's
    assert cache.victim({0, 1, 2, 3}, "carol") == 1
    cache.forget(1)
    assert cache.victim({0, 2, 3}, "bob") == 2  # two blocks each: bob's own go first
    assert cache.victim({0, 2, 3}, "carol") == 0  # carol holds none: the least recent of the largest
    cache.forget(2)
    assert cache.victim({0, 3}, "bob") == 0  # alice now holds more


async def test_through_the_fleet_a_follow_up_reports_its_cached_prompt_tokens_and_the_worker_counts_them(
    sdk: openai.OpenAI, client: httpx.AsyncClient, redis: Redis, served: str
) -> None:
    story = " ".join(["one two three four five six seven eight"] * 11)  # about 300 tokens (tiny model)
    [worker] = [w for w in await live_workers(redis, keys) if w["model"] == served]

    async def counted() -> tuple[float | None, float | None]:
        metrics = (await client.get(worker["metrics_url"])).text
        hits = value(metrics, "ortfleet_prefix_cache_hits_total", model=served)
        return hits, value(metrics, "ortfleet_prefix_cache_queries_total", model=served)

    first = sdk.completions.create(model=served, prompt=story, max_tokens=4, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens > 256
    details = first.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 0
    hits_before, queries_before = await counted()

    raw = sdk.completions.with_raw_response.create(
        model=served, prompt=story + " nine ten", max_tokens=4, temperature=0
    )
    again = raw.parse()
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 256  # the first whole chunk (256 tokens)
    job = (await client.get(f"/v1/jobs/{raw.headers['x-ortfleet-job-id']}")).json()
    assert job["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}

    hits, queries = await counted()
    assert hits is not None and hits_before is not None and hits - hits_before == 256
    assert queries is not None and queries_before is not None
    assert queries - queries_before == again.usage.prompt_tokens
