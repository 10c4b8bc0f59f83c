"""LoRA adapters on the paged engine (worker/engines/paged/), on the CPU graph through block tables
(cpu_model.py): rows of three adapters and of the base model in one run each give their tokens alone and
the batcher's for the same adapter; an adapter whose B is zero gives the base model's tokens; a prompt's
cached blocks are shared only between rows of one adapter; adapters load and unload at run time as on the
batcher. The CUDA runner's graph, rewritten the same way with a scale per packed token, is checked without
a card: tests/test_paged_lora_graph.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import numpy as np
import pytest

from tests.test_batcher import NEAR_TIE_LOGITS, Collected, collect
from tests.test_lora import PROMPTS, alone, batch, write_adapter
from worker.engine import GenerationRequest
from worker.engines.batcher.adapter_library import AdapterLibrary
from worker.engines.batcher.engine import BatchingEngine
from worker.engines.paged.cpu_model import CpuPagedModel
from worker.engines.paged.engine import PagedEngine
from worker.engines.paged.model import PackedRow

NAMES = ("first", "second", "third")


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., BatchingEngine]]:
    """Makes the paged engine on the CPU graph (or, `batcher`, the batcher) with these adapters."""
    made: list[BatchingEngine] = []

    def make(
        model_dir: Path, adapters: Mapping[str, Path], chunk: int = 16, batcher: bool = False
    ) -> BatchingEngine:
        engine: BatchingEngine
        if batcher:
            engine = BatchingEngine(model_dir, adapters=adapters, prefill_chunk=chunk)
        else:
            library = AdapterLibrary(model_dir, adapters)
            runner = lambda: CpuPagedModel(model_dir, 256, chunk, adapters=library)  # noqa: E731
            engine = PagedEngine(model_dir, runner, 8, chunk, adapters=library)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def three_adapters(folder: Path, model_dir: Path, strength: float = 2.0) -> dict[str, Path]:
    return {
        name: write_adapter(folder / name, model_dir, seed=seed, rank=rank, strength=strength)
        for seed, (name, rank) in enumerate(zip(NAMES, (2, 4, 8), strict=True), start=1)
    }


async def test_rows_of_three_adapters_and_the_base_in_one_paged_run_give_their_lone_and_the_batchers_tokens(
    tiny_model: Path, tmp_path: Path, engines: Callable[..., BatchingEngine]
) -> None:
    adapters = three_adapters(tmp_path, tiny_model)
    paged = engines(tiny_model, adapters)
    batcher = engines(tiny_model, adapters, batcher=True)
    prompts = [paged.tokenizer.encode(text) for text in PROMPTS]
    rows = [(prompt, adapter) for prompt in prompts for adapter in (*NAMES, None)][:8]

    lone = [await alone(paged, prompt, adapter, 24) for prompt, adapter in rows]
    batchers = [await alone(batcher, prompt, adapter, 24) for prompt, adapter in rows]
    together = await batch(paged, [p for p, _ in rows], [a for _, a in rows], 24)

    assert [row.tokens for row in together] == lone == batchers
    assert len({tuple(tokens) for tokens in lone[:4]}) == 4  # each adapter did change the text
    assert max(max(row.rows) for row in together) == len(rows)  # they did share the runs


def test_one_cpu_paged_run_gives_rows_of_three_adapters_and_the_base_the_logits_each_gets_alone(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The runner alone: four decoding rows, each of another adapter or the base model, and a prompt chunk
    in one run (the decodes share one run of the graph, the chunk runs apart), against each row run by
    itself on a fresh pool."""
    library = AdapterLibrary(tiny_model, three_adapters(tmp_path, tiny_model))
    adapters: list[str | None] = [*NAMES, None]
    prompts = [[5 + row, 9, 14 + row, 3, 7][: 3 + row % 3] for row in range(len(adapters))]
    tables = [[row] for row in range(len(adapters) + 1)]  # a block each, of 16 tokens
    chunk = PackedRow([11, 12, 13], 0, tables[-1], adapter="second")

    def prefilled() -> CpuPagedModel:
        model = CpuPagedModel(tiny_model, len(tables), 16, adapters=library)
        for prompt, table, adapter in zip(prompts, tables[:-1], adapters, strict=True):
            model.returned_logits([PackedRow(prompt, 0, table, adapter=adapter)])
        return model

    decodes = [
        PackedRow([20 + row], len(prompt), table, adapter=adapter)
        for row, (prompt, table, adapter) in enumerate(zip(prompts, tables[:-1], adapters, strict=True))
    ]
    together = prefilled().returned_logits([*decodes, chunk])
    alone = prefilled()
    each = [alone.returned_logits([row])[0] for row in (*decodes, chunk)]

    assert np.allclose(together, np.stack(each), atol=1e-5)
    assert not np.allclose(each[0], each[3], atol=1e-2)  # the adapter does change a row's logits


@pytest.mark.parametrize(
    "model", ["tiny_model", pytest.param("default_model", marks=pytest.mark.default_model)]
)
async def test_a_paged_adapter_whose_b_is_zero_gives_the_base_models_tokens(
    model: str, request: pytest.FixtureRequest, tmp_path: Path, engines: Callable[..., BatchingEngine]
) -> None:
    model_dir: Path = request.getfixturevalue(model)
    adapters = {
        "zero": write_adapter(tmp_path / "zero", model_dir, zero_b=True),
        "random": write_adapter(tmp_path / "random", model_dir, seed=1, strength=2.0),
    }
    paged = engines(model_dir, adapters, chunk=64)
    prompts = [paged.tokenizer.encode(text) for text in PROMPTS[:2]]

    together = await batch(paged, prompts * 3, [None] * 2 + ["zero"] * 2 + ["random"] * 2, 16)

    base, zero, random = ([row.tokens for row in together[i : i + 2]] for i in (0, 2, 4))
    assert zero == base and all(base)
    assert random != base


async def lone_steps(
    engine: BatchingEngine, prompt: list[int], adapter: str | None, count: int
) -> list[tuple[int, float]]:
    """Each greedy token of the prompt alone, and how far the likeliest logit is from the second."""
    [stream] = engine.submit([GenerationRequest(prompt, count, logprobs=2, adapter=adapter)])
    steps = []
    while True:
        update = await stream.updates.get()
        for token, logprobs in zip(update.token_ids, update.logprobs or (), strict=False):
            first, second = (value for _, value in logprobs.top[:2])
            steps.append((token, first - second))
        if update.finish is not None:
            return steps


def parts_only_at_near_ties(row: Collected, steps: list[tuple[int, float]]) -> None:
    tokens = [token for token, _ in steps]
    parted = next((i for i, (a, b) in enumerate(zip(row.tokens, tokens, strict=False)) if a != b), None)
    if parted is None:
        assert row.tokens == tokens
    else:
        assert steps[parted][1] < NEAR_TIE_LOGITS, f"token {parted} parted {steps[parted][1]:.3f} from a tie"


@pytest.mark.default_model
async def test_on_the_default_model_paged_rows_of_three_adapters_and_the_base_part_only_at_near_ties(
    default_model: Path, tmp_path: Path, engines: Callable[..., BatchingEngine]
) -> None:
    """Alone, a row's tokens on the paged engine are the batcher's: the same graph runs the same chunks and
    decodes. In one batch a base-model row's tokens are its lone tokens exactly (its delta is 0), an adapter
    row's may part from them only at a near-tie: the int4 graph runs adapters in int8, whose activations
    are quantized over the run's rows (tests/test_lora.py's test of the batcher says more)."""
    adapters = three_adapters(tmp_path, default_model, strength=0.3)
    paged = engines(default_model, adapters, chunk=64)
    batcher = engines(default_model, adapters, chunk=64, batcher=True)
    prompts = [paged.tokenizer.encode(text) for text in PROMPTS]
    rows = [(prompt, adapter) for prompt in prompts[:2] for adapter in (*NAMES, None)]

    lone = [await lone_steps(paged, prompt, adapter, 24) for prompt, adapter in rows]
    batchers = [await alone(batcher, prompt, adapter, 24) for prompt, adapter in rows]
    together = await batch(paged, [p for p, _ in rows], [a for _, a in rows], 24)

    assert [[token for token, _ in steps] for steps in lone] == batchers
    for (_, adapter), steps, row in zip(rows, lone, together, strict=True):
        if adapter is None:
            assert row.tokens == [token for token, _ in steps]
        parts_only_at_near_ties(row, steps)
    assert len({tuple(row.tokens) for row in together[:4]}) == 4  # each adapter did change the text
    assert max(max(row.rows) for row in together) == len(rows)  # they did share the runs


async def cached_tokens(engine: BatchingEngine, prompt: list[int], adapter: str | None) -> int:
    [stream] = engine.submit([GenerationRequest(prompt, 2, adapter=adapter)])
    update = await stream.updates.get()
    await collect(stream)  # the rest
    return update.cached_tokens or 0


async def test_a_prompts_cached_blocks_are_shared_only_between_paged_rows_of_one_adapter(
    tiny_model: Path, tmp_path: Path, engines: Callable[..., BatchingEngine]
) -> None:
    paged = engines(tiny_model, three_adapters(tmp_path, tiny_model))
    prompt = paged.tokenizer.encode("Hello! " * 12)  # whole blocks of 16 tokens and more

    assert await cached_tokens(paged, prompt, "first") == 0
    assert await cached_tokens(paged, prompt, "second") == 0
    assert await cached_tokens(paged, prompt, None) == 0
    assert await cached_tokens(paged, prompt, "first") >= 16
    assert await cached_tokens(paged, prompt, None) >= 16


async def test_a_paged_engine_loads_and_unloads_adapters_at_run_time_as_the_batcher_does(
    tiny_model: Path, tmp_path: Path, engines: Callable[..., BatchingEngine]
) -> None:
    adapters = three_adapters(tmp_path, tiny_model)
    started = engines(tiny_model, adapters)
    paged = engines(tiny_model, {})  # no adapter at start: its graph gains the projections at the load
    prompts = [paged.tokenizer.encode(text) for text in (PROMPTS[0], "Hello! " * 12)]  # one of 2 blocks
    expected = {name: [await alone(started, p, name, 16) for p in prompts] for name in (*NAMES, None)}

    for name in NAMES:
        await paged.load_adapter(name, adapters[name])
    rows = [(prompt, name) for name in (*NAMES, None) for prompt in prompts]
    together = await batch(paged, [p for p, _ in rows], [a for _, a in rows], 16)
    assert [row.tokens for row in together] == [t for name in (*NAMES, None) for t in expected[name]]

    await paged.unload_adapter("second")
    [refused] = [await collect(s) for s in paged.submit([GenerationRequest(prompts[0], 4, adapter="second")])]
    assert refused.error is not None and "'second' was unloaded" in refused.error
    for _ in range(100):  # its retirement runs in the background once its rows have ended
        if "second" not in (paged.adapters.names if paged.adapters else []):
            break
        await asyncio.sleep(0.02)
    await paged.load_adapter("second", adapters["first"])  # its name again, another adapter's weights
    assert await cached_tokens(paged, prompts[1], "second") == 0  # not the old one's cached blocks
    assert await alone(paged, prompts[1], "second", 16) == expected["first"][1]
