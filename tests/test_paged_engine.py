"""The paged engine (worker/engines/paged/engine.py) behind the engine seam, on real inference without a
card: its runs are the paged contract computed by the tiny model's CPU graph (cpu_model.py). A batch of
requests gets the CPU batcher's tokens, log-probabilities, prompt log-probabilities and seeded samples;
a cancel, a replay, the refusals and a failed run behave as the batcher's do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_batcher import Collected, collect
from worker.engine import EngineUpdate, Finish, GenerationRequest, GenerationStream, TokenLogprobs
from worker.engines.batcher.engine import BatchingEngine
from worker.engines.device_sampling.runner import SamplerGraph
from worker.engines.paged.cpu_model import CpuPagedModel
from worker.engines.paged.engine import PagedEngine

BLOCK = 16
CHUNK = 16


@pytest.fixture
async def paged(tiny_model: Path) -> AsyncIterator[Callable[..., PagedEngine]]:
    made: list[PagedEngine] = []

    def make(
        blocks: int = 64,
        capacity: int = 4,
        runner: Callable[[], Any] | None = None,
        graph: bool | Callable[[frozenset[int], int], SamplerGraph] = False,
    ) -> PagedEngine:
        engine = PagedEngine(
            tiny_model,
            runner or (lambda: CpuPagedModel(tiny_model, blocks, BLOCK)),
            capacity,
            CHUNK,
            sampler=graph if callable(graph) else SamplerGraph if graph else None,
        )
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


async def run_all(engine: PagedEngine | BatchingEngine, requests: list[GenerationRequest]) -> list[Collected]:
    return list(await asyncio.gather(*(collect(s) for s in engine.submit(requests))))


def requests(vocab: int) -> list[GenerationRequest]:
    rng = np.random.default_rng(5)
    opening = [int(t) for t in rng.integers(10, vocab, size=40)]
    prompts = [
        (opening if i % 3 == 0 else [])
        + [int(t) for t in rng.integers(10, vocab, size=int(rng.integers(1, 45)))]
        for i in range(7)
    ]
    return [
        GenerationRequest(prompts[0], 10, min_new_tokens=10),
        GenerationRequest(prompts[1], 8, min_new_tokens=8, logprobs=3),
        GenerationRequest(prompts[2], 12, temperature=0.8, seed=11),
        GenerationRequest(prompts[3], 9, temperature=1.0, top_k=20, seed=3, presence_penalty=0.5),
        GenerationRequest(prompts[4], 7, repetition_penalty=1.3, logit_bias=((12, 5.0),)),
        GenerationRequest(prompts[5], 10, min_new_tokens=10, frequency_penalty=0.8),
        GenerationRequest(prompts[6], 6, temperature=0.7, top_p=0.9, seed=8, logprobs=2),
    ]


@pytest.mark.parametrize("graph", [False, True], ids=["host sampling", "sampler graph"])
async def test_a_batch_gets_the_batchers_tokens_logprobs_and_seeded_samples(
    paged: Callable[..., PagedEngine], tiny_model: Path, graph: bool
) -> None:
    engine = paged(graph=graph)
    asked = requests(engine.vocab_size)
    ours = await run_all(engine, asked)
    batcher = BatchingEngine(tiny_model, slots=4, prefill_chunk=CHUNK)
    try:
        theirs = await run_all(batcher, asked)
    finally:
        batcher.close()
    for mine, reference in zip(ours, theirs, strict=True):
        assert (mine.finish, mine.error) == (reference.finish, None)
        assert mine.tokens == reference.tokens
    assert engine.counters.prefix_hits >= 1  # a later request with the shared opening reused its blocks
    assert engine.kv_tokens_reserved == 0 or engine.prefix_cache_tokens > 0


@pytest.mark.parametrize("graph", [False, True], ids=["host sampling", "sampler graph"])
async def test_log_probabilities_are_the_batchers(
    paged: Callable[..., PagedEngine], tiny_model: Path, graph: bool
) -> None:
    engine = paged(graph=graph)
    request = GenerationRequest(requests(engine.vocab_size)[1].prompt_ids, 6, min_new_tokens=6, logprobs=3)

    async def logprobs(
        target: PagedEngine | BatchingEngine,
    ) -> list[tuple[int, float, list[tuple[int, float]]]]:
        [stream] = target.submit([request])
        out = []
        while True:
            update = await stream.updates.get()
            for token, entry in zip(update.token_ids, update.logprobs or (), strict=False):
                out.append((token, entry.logprob, list(entry.top)))
            if update.finish is not None:
                return out

    batcher = BatchingEngine(tiny_model, slots=2, prefill_chunk=CHUNK)
    try:
        theirs = await logprobs(batcher)
    finally:
        batcher.close()
    ours = await logprobs(engine)
    assert len(ours) == 6
    for (token, value, top), (their_token, their_value, their_top) in zip(ours, theirs, strict=True):
        assert token == their_token and abs(value - their_value) < 1e-4
        assert [t for t, _ in top] == [t for t, _ in their_top]


@dataclass
class Answer:
    tokens: list[int]
    prompt_logprobs: tuple[TokenLogprobs, ...] | None
    cached_tokens: int | None


async def answer(stream: GenerationStream) -> Answer:
    """A request's tokens, and the prompt log-probabilities and cached tokens of its first update."""
    out: Answer | None = None
    tokens: list[int] = []
    while True:
        update = await stream.updates.get()
        assert update.error is None, update.error
        if out is None:
            out = Answer(tokens, update.prompt_logprobs, update.cached_tokens)
        else:
            assert update.prompt_logprobs is None  # the first update alone carries them
        tokens += update.token_ids
        if update.finish is not None:
            return out


async def answers(engine: PagedEngine | BatchingEngine, asked: list[GenerationRequest]) -> list[Answer]:
    return list(await asyncio.gather(*(answer(s) for s in engine.submit(asked))))


def assert_same_prompt_logprobs(
    ours: tuple[TokenLogprobs, ...] | None, theirs: tuple[TokenLogprobs, ...] | None, prompt: list[int]
) -> None:
    assert ours is not None and theirs is not None
    assert len(ours) == len(theirs) == len(prompt) - 1  # every prompt token after the first
    for mine, reference in zip(ours, theirs, strict=True):
        assert abs(mine.logprob - reference.logprob) < 1e-4
        assert [t for t, _ in mine.top] == [t for t, _ in reference.top]
        for (_, value), (_, their_value) in zip(mine.top, reference.top, strict=True):
            assert abs(value - their_value) < 1e-4


def long_prompt(vocab: int, seed: int = 9) -> list[int]:
    """A prompt over three prefill chunks (16, 16 and 13 tokens)."""
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab, size=45)]


async def batcher_answers(tiny_model: Path, asked: list[GenerationRequest]) -> list[Answer]:
    batcher = BatchingEngine(tiny_model, slots=4, prefill_chunk=CHUNK)
    try:
        return await answers(batcher, asked)
    finally:
        batcher.close()


@pytest.mark.parametrize(
    ("top", "graph"), [(0, False), (3, False), (3, True)], ids=["top 0", "top 3", "top 3, sampler graph"]
)
async def test_prompt_log_probabilities_across_chunks_are_the_batchers(
    paged: Callable[..., PagedEngine], tiny_model: Path, top: int, graph: bool
) -> None:
    engine = paged(graph=graph)
    prompt = long_prompt(engine.vocab_size)
    others = requests(engine.vocab_size)
    asked = [  # decoding rows share the asking row's runs: each run mixes its chunks with their tokens
        others[0],
        GenerationRequest(prompt, 6, min_new_tokens=6, prompt_logprobs=top, logprobs=2),
        others[2],
    ]
    ours = await answers(engine, asked)
    theirs = await batcher_answers(tiny_model, asked)
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.tokens == reference.tokens
    assert_same_prompt_logprobs(ours[1].prompt_logprobs, theirs[1].prompt_logprobs, prompt)
    assert all(len(entry.top) == top for entry in ours[1].prompt_logprobs or ())
    assert ours[0].prompt_logprobs is None and ours[2].prompt_logprobs is None


async def test_a_prompt_already_cached_still_gets_every_prompt_log_probability(
    paged: Callable[..., PagedEngine], tiny_model: Path
) -> None:
    engine = paged()  # the prefix cache on
    prompt = long_prompt(engine.vocab_size, seed=10)
    plain = GenerationRequest(prompt, 4, min_new_tokens=4)
    asking = GenerationRequest(prompt, 4, min_new_tokens=4, prompt_logprobs=2)
    [first] = await answers(engine, [plain])
    [again] = await answers(engine, [asking])  # its prompt's first blocks are cached: it reuses none
    [twice] = await answers(engine, [asking])
    [last] = await answers(engine, [plain])  # the cache still serves requests that do not ask
    [reference] = await batcher_answers(tiny_model, [asking])
    assert (first.cached_tokens, again.cached_tokens, twice.cached_tokens) == (0, 0, 0)
    assert last.cached_tokens == 2 * BLOCK  # whole blocks short of the prompt's last token
    for answered in (again, twice):
        assert answered.tokens == first.tokens == reference.tokens
        assert_same_prompt_logprobs(answered.prompt_logprobs, reference.prompt_logprobs, prompt)
    assert engine.counters.prefix_hits == 1
    pool = engine._paged_rows.scheduler.blocks
    pool.check()
    assert pool.available == pool.blocks


async def test_a_cancelled_request_ends_within_a_step_and_gives_its_blocks_back(
    paged: Callable[..., PagedEngine],
) -> None:
    engine = paged()
    long, short = GenerationRequest([5] * 30, 400, min_new_tokens=400), GenerationRequest([7, 8, 9], 5)
    streams = engine.submit([long, short])
    first = await streams[0].updates.get()
    assert first.token_ids
    engine.cancel(streams[0])
    while (update := await streams[0].updates.get()).finish is None:
        pass
    assert update.finish is Finish.cancelled
    assert (await collect(streams[1])).finish in (Finish.length, Finish.eos)
    assert engine.rows() == (0, 0, 0)
    pool = engine._paged_rows.scheduler.blocks
    pool.check()
    assert pool.available == pool.blocks


async def test_a_replayed_attempt_goes_on_exactly_where_it_stopped(paged: Callable[..., PagedEngine]) -> None:
    engine = paged()
    prompt = [9, 10, 11, 12, 13] * 5
    [whole] = await run_all(engine, [GenerationRequest(prompt, 12, min_new_tokens=12)])
    [resumed] = await run_all(
        engine, [GenerationRequest(prompt, 7, min_new_tokens=7, replay_ids=tuple(whole.tokens[:5]))]
    )
    assert resumed.tokens == whole.tokens[5:]
    assert resumed.replay_exact is True


async def test_a_request_it_cannot_serve_is_refused_by_name(paged: Callable[..., PagedEngine]) -> None:
    engine = paged(blocks=4)  # 64 tokens of KV
    [too_big] = await run_all(engine, [GenerationRequest([5] * 40, 40)])
    assert too_big.finish is Finish.error
    assert "needs 80 tokens of KV cache" in (too_big.error or "") and "the paged KV pool" in (
        too_big.error or ""
    )


async def test_a_failed_run_loses_every_row_and_a_restart_serves_again(
    paged: Callable[..., PagedEngine], tiny_model: Path
) -> None:
    runs = {"made": 0}

    class Breaking(CpuPagedModel):
        def returned_logits(self, rows):  # type: ignore[no-untyped-def]
            if runs["made"] == 1 and self.broken:
                raise RuntimeError("the card fell off the bus")
            return super().returned_logits(rows)

    def make() -> CpuPagedModel:
        runs["made"] += 1
        model = Breaking(tiny_model, 64, BLOCK)
        model.broken = True  # type: ignore[attr-defined]
        return model

    engine = paged(runner=make)
    failures: list[str] = []
    engine.on_failure = failures.append
    [lost] = await run_all(engine, [GenerationRequest([5, 6, 7], 4)])
    assert lost.finish is Finish.lost and "the card fell off the bus" in (lost.error or "")
    await engine.restart()
    [served] = await run_all(engine, [GenerationRequest([5, 6, 7], 4, min_new_tokens=4)])
    assert served.finish is Finish.length and len(served.tokens) == 4
    assert runs["made"] == 2


async def every_update(stream: GenerationStream) -> list[EngineUpdate]:
    updates = [await stream.updates.get()]
    while updates[-1].finish is None:
        updates.append(await stream.updates.get())
    return updates


async def test_plain_rows_done_without_the_per_token_path_get_the_updates_it_gives(
    paged: Callable[..., PagedEngine],
) -> None:
    """The sampler graph's plain rows (no grammar, replay or first update, a token that ends nothing) skip
    `_next`: every update of every request is the one `_next` gives, when rows end around them too."""
    vocab = 320
    rng = np.random.default_rng(21)
    prompt = [int(t) for t in rng.integers(10, vocab, size=20)]
    asked = [
        *requests(vocab),
        GenerationRequest(prompt, 30, temperature=1.5, seed=4),  # may end on end of sequence
        GenerationRequest(prompt, 30, temperature=1.5, seed=7, logprobs=1),
        GenerationRequest([int(t) for t in rng.integers(10, vocab, size=495)], 40),  # ends at the context
        GenerationRequest(prompt, 9, guidance=("regex", "[a-z ]*")),
        GenerationRequest(prompt, 8, min_new_tokens=8, replay_ids=(40, 41, 42)),
    ]

    through_next = {True: 0, False: 0}

    async def run(fast: bool) -> list[list[EngineUpdate]]:
        engine = paged(blocks=128, capacity=8, graph=True)
        engine.fast_plain_rows = fast
        general_path = engine._next

        def counted(*args: Any) -> None:
            through_next[fast] += 1
            general_path(*args)

        engine._next = counted  # type: ignore[method-assign,assignment]
        return list(await asyncio.gather(*(every_update(s) for s in engine.submit(asked))))

    fast, general = await run(True), await run(False)
    assert fast == general
    assert {update.finish for updates in fast for update in updates} == {None, Finish.eos, Finish.length}
    assert through_next[True] < through_next[False] / 3  # most tokens took the plain rows' path


class HostLogitsOnly:
    """A CpuPagedModel seen through `returned_logits` alone (no `run`): the paged engine brings every row's
    logits to the host, its path before it read them where they lie."""

    def __init__(self, model: CpuPagedModel) -> None:
        self._model = model
        self.blocks, self.block_size, self.vocab = model.blocks, model.block_size, model.vocab

    def returned_logits(self, rows: Any) -> np.ndarray:
        return self._model.returned_logits(rows)


class CountingGraph(SamplerGraph):
    """The sampler graph, counting the rows it flags for the host and the rows brought to the host."""

    def __init__(self, eos_token_ids: frozenset[int], vocab_size: int) -> None:
        super().__init__(eos_token_ids, vocab_size)
        self.rows = self.flagged = self.gathers = self.fetched = 0

    def run_packed(self, feeds: dict[str, np.ndarray], logits: Any, taken: Any = None) -> Any:
        step = super().run_packed(feeds, logits, taken)
        self.rows += len(step.host)
        self.flagged += int(step.host.sum())
        return step

    def host_rows(self, logits: Any, index: np.ndarray) -> np.ndarray:
        self.gathers += 1
        self.fetched += len(index)
        return super().host_rows(logits, index)


def mixed_batch(vocab: int) -> list[GenerationRequest]:
    """Greedy, seeded temperature, top_k and top_p rows, a grammar's, and a row asking for its prompt's
    log-probabilities (greedy: the graph serves its token)."""
    rng = np.random.default_rng(17)
    prompts = [[int(t) for t in rng.integers(10, vocab, size=int(rng.integers(5, 40)))] for _ in range(6)]
    return [
        GenerationRequest(prompts[0], 8, min_new_tokens=8, logprobs=2),
        GenerationRequest(prompts[1], 8, temperature=0.9, seed=5, logprobs=1),
        GenerationRequest(prompts[2], 8, temperature=1.0, top_k=20, seed=6, repetition_penalty=1.2),
        GenerationRequest(prompts[3], 8, temperature=0.8, top_p=0.9, seed=7, logprobs=3),
        GenerationRequest(prompts[4], 8, guidance=("regex", "[a-z ]*")),
        GenerationRequest(prompts[5], 6, min_new_tokens=6, prompt_logprobs=2),
    ]


async def test_the_sampler_graph_on_the_logits_where_they_lie_gives_every_update_the_host_path_gives(
    paged: Callable[..., PagedEngine], tiny_model: Path
) -> None:
    """With a runner that gives its logits where they lie (`run`), the sampler graph reads them there and
    the host gets only the rows it reads; every update (tokens, log-probabilities, prompt log-probabilities,
    a grammar's row) is the one the engine gives with every row's logits on the host."""

    async def updates(engine: PagedEngine, asked: list[GenerationRequest]) -> list[list[EngineUpdate]]:
        streams = await asyncio.gather(*(every_update(s) for s in engine.submit(asked)))
        # the running rows each update counts depend on when the engine's thread took the requests
        return [[replace(update, batch_rows=0) for update in stream] for stream in streams]

    device = paged(capacity=8, graph=True)
    asked = mixed_batch(device.vocab_size)
    on_device = await updates(device, asked)
    host = await updates(
        paged(capacity=8, graph=True, runner=lambda: HostLogitsOnly(CpuPagedModel(tiny_model, 64, BLOCK))),
        asked,
    )
    assert on_device == host
    sampled_on_host = await updates(paged(capacity=8), asked)
    tokens = [[update.token_ids for update in row] for row in on_device]
    assert tokens == [[update.token_ids for update in row] for row in sampled_on_host]
    prompt_logprobs = on_device[5][0].prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(asked[5].prompt_ids) - 1


async def test_on_the_device_path_the_host_gets_only_the_rows_it_reads_in_one_gather_a_step(
    paged: Callable[..., PagedEngine], tiny_model: Path
) -> None:
    """The rows the graph flags (the grammar's at every step among them) and the prompt chunk that asks
    for its log-probabilities come to the host, each once, in at most one gather a step; no other row."""
    graphs: list[CountingGraph] = []
    runs = {"count": 0}

    def graph(eos: frozenset[int], vocab: int) -> CountingGraph:
        graphs.append(CountingGraph(eos, vocab))
        return graphs[-1]

    class Counted(CpuPagedModel):
        def run(self, rows: Any) -> Any:
            runs["count"] += 1
            return super().run(rows)

    engine = paged(capacity=8, graph=graph, runner=lambda: Counted(tiny_model, 64, BLOCK))
    asked = mixed_batch(engine.vocab_size)
    done = await run_all(engine, asked)
    [counted] = graphs
    grammar_tokens = len(done[4].tokens) + (done[4].finish is Finish.eos)  # its end of sequence, picked too
    assert counted.flagged >= grammar_tokens > 0
    assert counted.fetched == counted.flagged + len(asked[5].prompt_ids)
    assert 0 < counted.gathers <= runs["count"]
    assert counted.flagged < counted.rows / 2  # most sampling rows' logits stayed where the model left them
