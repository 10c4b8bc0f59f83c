"""The paged engine (ORTFLEET_SCHEDULER=paged) on a card: the default model's greedy tokens against
og.Engine's, the log-probabilities og.Engine cannot give, prompt log-probabilities and LoRA adapters'
greedy text against the CPU batcher's on the same weights. Skipped where onnxruntime-genai cannot use
CUDA; `scripts/gpu-report` runs it on a GPU host."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

from common.worker_settings import WorkerSettings
from tests.gpu_marks import ON_A_GPU
from tests.test_batcher import Collected
from tests.test_lora import batch, write_adapter
from tests.test_paged_lora import lone_steps, parts_only_at_near_ties
from worker.engine import GenerationRequest, TokenLogprobs
from worker.engines.batcher.engine import BatchingEngine
from worker.engines.device import Device
from worker.engines.engine_choice import open_engine
from worker.engines.paged.model import PagedModel

pytestmark = ON_A_GPU

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]


@pytest.fixture(scope="module")
def cuda_model() -> Path:
    from common.settings import FleetSettings
    from ortfleet.modelbuild.default import ensure_default_model

    return ensure_default_model(FleetSettings().model_cache, device="cuda")


@pytest.fixture(scope="module")
def float_cpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's weights in fp32 for the CPU (about a minute to build): the CPU batcher's model
    to hold the card's fp16 log-probabilities against. The CPU default is int4, whose prompt
    log-probabilities are about 0.8 from fp32's on average, too far to check anything by."""
    from ortfleet.modelbuild.cache import install_model
    from ortfleet.modelbuild.convert import StageProgress
    from ortfleet.modelbuild.default import DEFAULT_MODEL_SOURCE, DefaultVariant, _convert

    recipe = "smollm2-135m-instruct-gguf-to-fp32-cpu/1"
    variant = DefaultVariant("smollm2-135m-instruct-fp32-cpu", recipe, "fp32", "cpu")
    return install_model(
        tmp_path_factory.mktemp("fp32") / variant.name,
        lambda work, staged: _convert(work, staged, variant, StageProgress(4, enabled=False)),
        source=DEFAULT_MODEL_SOURCE,
        recipe=recipe,
    )


def generate(
    model_dir: Path,
    scheduler: str,
    requests: list[GenerationRequest],
    cuda_graph: Literal["auto", "on", "off"] = "auto",
    graph_runs: list[int] | None = None,
) -> list[tuple[list[int], int]]:
    """Each request's tokens and the log-probability entries it got, on a fresh engine of that kind; the
    paged engine's runs replayed as CUDA graphs added to `graph_runs` where given."""

    async def run() -> list[tuple[list[int], int]]:
        settings = WorkerSettings(scheduler=scheduler, gpu_kv_fraction=0.2, cuda_graph=cuda_graph)
        engine = open_engine(model_dir, Device("cuda", 0), settings)
        try:
            out = []
            for stream in engine.submit(requests):
                tokens, entries = [], 0
                while True:
                    update = await stream.updates.get()
                    tokens += update.token_ids
                    entries += len(update.logprobs or ())
                    if update.finish is not None:
                        assert update.error is None, update.error
                        break
                out.append((tokens, entries))
            if graph_runs is not None:
                runner = engine._runner  # type: ignore[union-attr]  # the paged engine's
                assert isinstance(runner, PagedModel)
                graph_runs.append(0 if runner.graphs is None else runner.graphs.runs)
            return out
        finally:
            engine.close()

    return asyncio.run(run())


def test_the_paged_engine_on_the_card_gives_og_engines_greedy_tokens(cuda_model: Path) -> None:
    engine = open_engine(cuda_model, Device("cuda", 0), WorkerSettings(scheduler="og-engine"))
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    engine.close()
    asked = [GenerationRequest(p, 24, min_new_tokens=24) for p in ids]
    ours = generate(cuda_model, "paged", asked)
    theirs = generate(cuda_model, "og-engine", asked)
    equal = sum(a[0] == b[0] for a, b in zip(ours, theirs, strict=True))
    assert equal >= len(asked) - 1, (ours, theirs)  # fp16 kernels of another batch shape may split a near-tie


def test_the_paged_engine_on_the_card_gives_the_same_greedy_text_with_cuda_graphs_as_without(
    cuda_model: Path,
) -> None:
    engine = open_engine(cuda_model, Device("cuda", 0), WorkerSettings(scheduler="og-engine"))
    more = ["Name two rivers in Europe.", "Count from one to ten in French."]
    ids = [engine.tokenizer.encode(p) for p in [*PROMPTS, *more]]
    engine.close()
    asked = [GenerationRequest(p, 32, min_new_tokens=32) for p in ids]  # five rows: a bucket of eight
    runs: list[int] = []
    with_graphs = generate(cuda_model, "paged", asked, cuda_graph="on", graph_runs=runs)
    without = generate(cuda_model, "paged", asked, cuda_graph="off", graph_runs=runs)
    assert runs[0] >= 16 and runs[1] == 0  # decode steps replayed graphs, and none with them off
    equal = sum(a[0] == b[0] for a, b in zip(with_graphs, without, strict=True))
    assert equal >= len(asked) - 1, (with_graphs, without)  # fp16 of another batch shape may split a near-tie


def test_the_paged_engine_on_the_card_gives_log_probabilities(cuda_model: Path) -> None:
    engine = open_engine(cuda_model, Device("cuda", 0), WorkerSettings(scheduler="og-engine"))
    ids = engine.tokenizer.encode(PROMPTS[0])
    engine.close()
    [(tokens, entries)] = generate(
        cuda_model, "paged", [GenerationRequest(ids, 8, min_new_tokens=8, logprobs=5)]
    )
    assert len(tokens) == 8 and entries == 8


def prompt_logprobs(engine: BatchingEngine, requests: list[GenerationRequest]) -> tuple[TokenLogprobs, ...]:
    """The requests on `engine` one after another (closed afterwards): the last one's prompt
    log-probabilities, from its first update."""

    async def run() -> tuple[TokenLogprobs, ...]:
        try:
            found = None
            for request in requests:
                [stream] = engine.submit([request])
                while True:
                    update = await stream.updates.get()
                    assert update.error is None, update.error
                    found = found if update.prompt_logprobs is None else update.prompt_logprobs
                    if update.finish is not None:
                        break
            assert found is not None
            return found
        finally:
            engine.close()

    return asyncio.run(run())


def test_the_paged_engine_on_the_card_gives_the_cpu_batchers_prompt_log_probabilities(
    cuda_model: Path, float_cpu_model: Path
) -> None:
    batcher = BatchingEngine(float_cpu_model, slots=2, prefill_chunk=64)
    text = " ".join(f"{prompt} Answer {n}, in a land far away." for n in range(12) for prompt in PROMPTS)
    ids = batcher.tokenizer.encode(text)
    assert len(ids) > 256  # a whole KV block of the card's (256 tokens) and more
    asked = GenerationRequest(ids, 2, prompt_logprobs=3)
    theirs = prompt_logprobs(batcher, [asked])
    settings = WorkerSettings(scheduler="paged", gpu_kv_fraction=0.2, prefill_chunk_tokens=64)
    engine = open_engine(cuda_model, Device("cuda", 0), settings)
    assert isinstance(engine, BatchingEngine)  # the paged engine
    # The prompt's first block cached by a request that does not ask: the asking one reuses none of it, and
    # its prompt runs in chunks of 64 tokens.
    ours = prompt_logprobs(engine, [GenerationRequest(ids, 2), asked])
    assert len(ours) == len(theirs) == len(ids) - 1
    gaps = np.array([abs(mine.logprob - other.logprob) for mine, other in zip(ours, theirs, strict=True)])
    # fp16 on the card against fp32 on the CPU; a position off by one, or another row's logits, would be
    # nats away
    assert gaps.mean() < 5e-2 and gaps.max() < 0.2, gaps.round(3).tolist()
    assert all(len(entry.top) == 3 for entry in ours)


def test_a_paged_gpu_workers_adapter_rows_give_the_cpu_batchers_greedy_text_within_near_ties(
    cuda_model: Path, float_cpu_model: Path, tmp_path: Path
) -> None:
    """Rows of three adapters and of the base model in one batch on the card (the CUDA paged graph
    rewritten in fp16, a scale per packed token) against each row alone on the CPU batcher with the same
    adapters on the same weights in fp32: a row's tokens may part from the batcher's only where the
    batcher's two likeliest tokens are within NEAR_TIE_LOGITS."""
    names = ("first", "second", "third")
    adapters = {
        name: write_adapter(tmp_path / name, float_cpu_model, seed=seed, rank=8, strength=0.3)
        for seed, name in enumerate(names, start=1)
    }
    rows = [(prompt, adapter) for prompt in PROMPTS[:2] for adapter in (*names, None)]

    async def run() -> tuple[list[list[tuple[int, float]]], list[Collected]]:
        batcher = BatchingEngine(float_cpu_model, adapters=adapters, prefill_chunk=64)
        settings = WorkerSettings(scheduler="paged", gpu_kv_fraction=0.2, lora_modules=adapters)
        paged = open_engine(cuda_model, Device("cuda", 0), settings)
        try:
            ids = [batcher.tokenizer.encode(prompt) for prompt, _ in rows]
            lone = [await lone_steps(batcher, p, a, 24) for p, (_, a) in zip(ids, rows, strict=True)]
            together = await batch(paged, ids, [adapter for _, adapter in rows], 24)
            return lone, together
        finally:
            batcher.close()
            paged.close()

    lone, together = asyncio.run(run())
    for steps, row in zip(lone, together, strict=True):
        parts_only_at_near_ties(row, steps)
    assert len({tuple(row.tokens) for row in together[:4]}) == 4  # each adapter did change the text
    assert max(max(row.rows) for row in together) == len(rows)  # they did share the runs
