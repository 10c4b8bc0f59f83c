"""The paged engine (worker/engines/paged/engine.py) behind the engine seam, on real inference without a
card: its runs are the paged contract computed by the tiny model's CPU graph (cpu_model.py). A batch of
requests gets the CPU batcher's tokens, log-probabilities and seeded samples; a cancel, a replay, the
refusals and a failed run behave as the batcher's do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest

from tests.test_batcher import Collected, collect
from worker.engine import Finish, GenerationRequest
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
        runner: Callable[[], CpuPagedModel] | None = None,
        graph: bool = False,
    ) -> PagedEngine:
        engine = PagedEngine(
            tiny_model,
            runner or (lambda: CpuPagedModel(tiny_model, blocks, BLOCK)),
            capacity,
            CHUNK,
            sampler=SamplerGraph if graph else None,
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


async def test_requests_it_cannot_serve_are_refused_by_name(paged: Callable[..., PagedEngine]) -> None:
    engine = paged(blocks=4)  # 64 tokens of KV
    [prompt_logprobs, too_big] = await run_all(
        engine,
        [GenerationRequest([5, 6, 7], 4, prompt_logprobs=2), GenerationRequest([5] * 40, 40)],
    )
    assert prompt_logprobs.error_code == "unsupported_parameter"
    assert "prompt_logprobs" in (prompt_logprobs.error or "")
    assert too_big.finish is Finish.error
    assert "needs 80 tokens of KV cache" in (too_big.error or "") and "the paged KV pool" in (
        too_big.error or ""
    )


async def test_a_failed_run_loses_every_row_and_a_restart_serves_again(
    paged: Callable[..., PagedEngine], tiny_model: Path
) -> None:
    runs = {"made": 0}

    class Breaking(CpuPagedModel):
        def last_logits(self, rows):  # type: ignore[no-untyped-def]
            if runs["made"] == 1 and self.broken:
                raise RuntimeError("the card fell off the bus")
            return super().last_logits(rows)

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
