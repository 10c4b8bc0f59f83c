"""The paged scheduler on real models without a card: its runs computed by the model's own CPU graph
through block tables (worker/engines/paged/cpu_model.py). A batch of requests, some prompts longer than a
chunk and some sharing an opening, gives every request the tokens ortfleet's batcher gives it, on the tiny
model and on the default model; a prompt chunk that asks for all its logits gets each position's, those of
the graph run on the whole prompt at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tests.test_batcher import collect
from worker.engine import GenerationRequest
from worker.engines.batcher.engine import BatchingEngine
from worker.engines.batcher.graph import DecoderGraph, open_session
from worker.engines.batcher.sampler import RowSampler
from worker.engines.genai_config import eos_token_ids
from worker.engines.paged.blocks import BlockManager
from worker.engines.paged.cpu_model import CpuPagedModel
from worker.engines.paged.model import PackedRow, by_row
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
        logits = model.returned_logits([p.packed for p in planned])
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


def whole_prompt_logits(model_dir: Path, prompt: list[int]) -> np.ndarray:
    """Every position's logits [tokens, vocab] of the model's graph run once on the whole prompt, as the
    batcher runs it (worker/engines/batcher/graph.py)."""
    session, layout = open_session(model_dir)
    shape = (1, layout.kv_heads, len(prompt), layout.head_size)
    kv = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for _ in layout.past_names]
    ids, mask = np.asarray([prompt], np.int64), np.ones((1, len(prompt)), np.int64)
    logits: np.ndarray = DecoderGraph(session, layout).run(ids, mask, (0, 1), kv)[0]
    return logits


def test_a_chunk_that_asks_for_all_its_logits_gets_every_positions_in_runs_with_other_rows(
    tiny_model: Path,
) -> None:
    model = CpuPagedModel(tiny_model, 16, BLOCK)
    asking = [int(t) for t in np.random.default_rng(4).integers(10, model.vocab, size=40)]
    decoding, short = [11, 12, 13, 14, 15], [21, 22, 23]
    [first] = model.returned_logits([PackedRow(decoding, 0, [0])])  # its prompt in; it decodes from here on
    token, got = int(np.argmax(first)), []
    asking_table, short_table = [1, 2, 3], [4]
    for step, start in enumerate(range(0, len(asking), CHUNK)):  # its prompt in chunks of 16, 16 and 8
        chunk = asking[start : start + CHUNK]
        rows = [
            PackedRow([token], len(decoding) + step, [0]),
            PackedRow(chunk, start, asking_table, all_logits=True),
            PackedRow(short, 0, short_table),
        ]
        logits = model.returned_logits(rows)
        assert logits.shape == (1 + len(chunk) + 1, model.vocab)
        [decoded, prompt_part, short_part] = by_row(rows, logits)
        assert prompt_part.shape == (len(chunk), model.vocab) and short_part.shape == (1, model.vocab)
        np.testing.assert_allclose(short_part[0], whole_prompt_logits(tiny_model, short)[-1], atol=1e-4)
        got.extend(prompt_part)
        token = int(np.argmax(decoded[0]))
    np.testing.assert_allclose(np.stack(got), whole_prompt_logits(tiny_model, asking), atol=1e-4)
