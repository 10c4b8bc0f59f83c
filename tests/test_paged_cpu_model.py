"""The paged scheduler on real models without a card: its runs computed by the model's own CPU graph
through block tables (worker/engines/paged/cpu_model.py). A batch of requests, some prompts longer than a
chunk and some sharing an opening, gives every request the tokens ortfleet's batcher gives it, on the tiny
model and on the default model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests.test_batcher import collect
from worker.engine import GenerationRequest
from worker.engines.batcher.engine import BatchingEngine
from worker.engines.batcher.sampler import RowSampler
from worker.engines.genai_config import eos_token_ids
from worker.engines.paged.blocks import BlockManager
from worker.engines.paged.cpu_model import CpuPagedModel
from worker.engines.paged.scheduler import PagedRow, Scheduler

CHUNK = 16
BLOCK = 16


def prompts(vocab: int, count: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    opening = [int(t) for t in rng.integers(10, vocab, size=40)]  # two whole blocks and more
    out = []
    for index in range(count):
        tail = [int(t) for t in rng.integers(10, vocab, size=int(rng.integers(1, 50)))]
        out.append(opening + tail if index % 3 == 0 else tail)
    return out


def batcher_tokens(model_dir: Path, requests: list[GenerationRequest]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        engine = BatchingEngine(model_dir, slots=4, prefill_chunk=CHUNK, prefix_cache=False)
        try:
            out = [await collect(stream) for stream in engine.submit(requests)]
            assert all(result.error is None for result in out), out
            return [result.tokens for result in out]
        finally:
            engine.close()

    return asyncio.run(run())


def paged_tokens(
    model_dir: Path, requests: list[GenerationRequest], eos: frozenset[int]
) -> tuple[list[list[int]], int]:
    """Each request's greedy tokens through the scheduler on the CPU paged model; the prompt tokens reused."""
    blocks = BlockManager(48, BLOCK)
    model = CpuPagedModel(model_dir, blocks.blocks, BLOCK)
    scheduler = Scheduler(blocks, capacity=4, prefill_chunk=CHUNK)
    rows = [PagedRow(r.prompt_ids, r.max_new_tokens) for r in requests]
    samplers = {row: RowSampler(r, eos, model.vocab, None) for row, r in zip(rows, requests, strict=True)}
    for row in rows:
        scheduler.submit(row)
    while any(True for _ in scheduler.rows()):
        planned = scheduler.plan()
        logits = model.last_logits([p.packed for p in planned])
        scheduler.advance(planned)
        for plan, row_logits in zip(planned, logits, strict=True):
            if plan.samples:
                sampler = samplers[plan.row]
                plan.row.generated.append(sampler.choose(row_logits, len(plan.row.generated)))
                sampler.accept(plan.row.generated[-1])
        for plan in planned:
            if plan.samples and len(plan.row.generated) >= plan.row.max_new_tokens:
                scheduler.end(plan.row)
        blocks.check()
    return [row.generated for row in rows], sum(row.reused for row in rows)


@pytest.mark.parametrize("model_name", ["tiny_model", "default_model"])
def test_the_paged_scheduler_on_the_cpu_graph_gives_every_request_the_batchers_tokens(
    model_name: str, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(model_name)
    vocab = CpuPagedModel(model_dir, 1, BLOCK).vocab
    tokens = 12 if model_name == "tiny_model" else 8
    asked = [GenerationRequest(p, tokens, min_new_tokens=tokens) for p in prompts(vocab, 9)]
    ours, reused = paged_tokens(model_dir, asked, eos_token_ids(model_dir))
    theirs = batcher_tokens(model_dir, asked)
    assert ours == theirs
    assert reused >= 2 * BLOCK  # later rows with the shared opening reused its whole blocks
