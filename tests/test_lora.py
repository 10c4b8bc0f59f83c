"""LoRA adapters on the CPU batcher (worker/engines/batcher/lora.py, lora_graph.py), on real ONNX Runtime
inference: rows of different adapters and of the base model in one run, each as it would be alone; an
adapter equal to its weights merged into the model; adapters that do not fit the model refused by name."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_batcher import NEAR_TIE_LOGITS, Collected, collect
from worker.engine import EngineUpdate, Finish, GenerationRequest, GenerationStream
from worker.engines.batcher.adapter_library import AdapterLibrary
from worker.engines.batcher.engine import BatchingEngine
from worker.engines.batcher.lora import (
    AdapterMismatch,
    AdapterSet,
    read_adapter,
    read_safetensors,
)
from worker.engines.batcher.lora_graph import LoraGraph
from worker.engines.genai_config import read_genai

save_file = pytest.importorskip("safetensors.numpy").save_file

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INTERMEDIATE = {64: 128, 576: 1536}  # the tiny model's and SmolLM2-135M's MLP width, by hidden size
PROMPTS = ("Once upon a time", "The capital of France is", "1 2 3 4 5 6 7 8", "Hello! How are you today?")


def module_shapes(model_dir: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The model's layer count and each target module's (in, out) features, from its config (not from
    the graph the code under test reads)."""
    decoder = read_genai(model_dir)["model"]["decoder"]
    hidden, head = decoder["hidden_size"], decoder["head_size"]
    q, kv, mlp = (
        decoder["num_attention_heads"] * head,
        decoder["num_key_value_heads"] * head,
        INTERMEDIATE[hidden],
    )
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, mlp),
        "up_proj": (hidden, mlp),
        "down_proj": (mlp, hidden),
    }
    return decoder["num_hidden_layers"], shapes


def write_adapter(
    folder: Path,
    model_dir: Path,
    *,
    seed: int = 0,
    rank: int = 4,
    alpha: float = 8.0,
    modules: Iterable[str] = ALL_MODULES,
    zero_b: bool = False,
    strength: float = 1.0,
    config: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A random LoRA adapter in PEFT's files (A ~ N(0, 1/in), B ~ N(0, strength^2 / rank))."""
    layers, shapes = module_shapes(model_dir)
    rng = np.random.default_rng(seed)
    weights = {}
    modules = list(modules)
    for layer in range(layers):
        for module in modules:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = shapes[module]
            weights[f"{key}.lora_A.weight"] = rng.normal(0, fan_in**-0.5, (rank, fan_in)).astype(np.float32)
            b = rng.normal(0, strength / rank**0.5, (fan_out, rank)).astype(np.float32)
            weights[f"{key}.lora_B.weight"] = np.zeros_like(b) if zero_b else b
    weights.update(tensors or {})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        **(config or {}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))
    return folder


async def first_update(stream: GenerationStream) -> EngineUpdate:
    """The stream's first update, once the stream has ended."""
    updates = [await stream.updates.get()]
    while updates[-1].finish is None:
        updates.append(await stream.updates.get())
    return updates[0]


async def batch(
    engine: BatchingEngine, prompts: list[list[int]], adapters: list[str | None], count: int
) -> list[Collected]:
    """Each prompt's greedy generation, all submitted at once (one batch)."""
    requests = [GenerationRequest(p, count, adapter=a) for p, a in zip(prompts, adapters, strict=True)]
    results = await asyncio.gather(*(collect(stream) for stream in engine.submit(requests)))
    for result in results:
        assert result.finish in (Finish.eos, Finish.length), result.error
    return list(results)


async def greedy(
    engine: BatchingEngine, prompts: list[list[int]], adapters: list[str | None], count: int
) -> list[list[int]]:
    return [result.tokens for result in await batch(engine, prompts, adapters, count)]


async def alone(engine: BatchingEngine, prompt: list[int], adapter: str | None, count: int) -> list[int]:
    [tokens] = await greedy(engine, [prompt], [adapter], count)
    return tokens


@pytest.mark.parametrize(
    "model", ["tiny_model", pytest.param("default_model", marks=pytest.mark.default_model)]
)
async def test_an_adapter_whose_b_is_zero_gives_the_base_models_tokens_and_a_random_one_changes_them(
    model: str, request: pytest.FixtureRequest, tmp_path: Path, engines: list[BatchingEngine]
) -> None:
    model_dir: Path = request.getfixturevalue(model)
    count = 24 if model == "tiny_model" else 16
    adapters = {
        "zero": write_adapter(tmp_path / "zero", model_dir, zero_b=True),
        "random": write_adapter(tmp_path / "random", model_dir, seed=1, strength=2.0),
    }
    base = BatchingEngine(model_dir)
    engines.append(base)
    lora = BatchingEngine(model_dir, adapters=adapters)
    engines.append(lora)
    prompts = [base.tokenizer.encode(text) for text in PROMPTS[:2]]

    for prompt in prompts:
        expected = await alone(base, prompt, None, count)
        assert expected
        assert await alone(lora, prompt, "zero", count) == expected
        assert await alone(lora, prompt, None, count) == expected
    changed = [await alone(lora, p, "random", count) != await alone(base, p, None, count) for p in prompts]
    assert any(changed)


async def test_rows_of_three_adapters_and_the_base_model_in_one_batch_each_give_their_tokens_alone(
    tiny_model: Path, tmp_path: Path, engines: list[BatchingEngine]
) -> None:
    names = ("first", "second", "third")
    adapters = {
        name: write_adapter(tmp_path / name, tiny_model, seed=seed, rank=rank, strength=2.0)
        for seed, (name, rank) in enumerate(zip(names, (2, 4, 8), strict=True), start=1)
    }
    engine = BatchingEngine(tiny_model, adapters=adapters, prefill_chunk=8)
    engines.append(engine)
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    rows = [(prompt, adapter) for prompt in prompts for adapter in (*names, None)][:8]

    expected = [await alone(engine, prompt, adapter, 24) for prompt, adapter in rows]
    together = await batch(engine, [p for p, _ in rows], [a for _, a in rows], 24)

    assert [row.tokens for row in together] == expected
    by_adapter = {
        adapter: tokens
        for (prompt, adapter), tokens in zip(rows, expected, strict=True)
        if prompt == prompts[0]
    }
    assert len({tuple(tokens) for tokens in by_adapter.values()}) == 4  # each adapter did change the text
    assert max(max(row.rows) for row in together) == len(rows)  # they did share the batch


@pytest.mark.default_model
async def test_on_the_default_model_rows_of_three_adapters_and_the_base_give_their_lone_tokens_or_near_ties(
    default_model: Path, tmp_path: Path, engines: list[BatchingEngine]
) -> None:
    """A base-model row's tokens are its lone tokens exactly (its delta is 0). An adapter row's may part
    from them, only where the lone run's two likeliest tokens are within NEAR_TIE_LOGITS: the int4 graph
    runs adapters in int8 (DynamicQuantizeMatMul quantizes a run's activations as one tensor), a batch's
    products sum in another order than a lone row's, and the int4 projections' int8 activations round
    these differences up."""
    names = ("first", "second", "third")
    adapters = {
        name: write_adapter(tmp_path / name, default_model, seed=seed, rank=8, strength=0.3)
        for seed, name in enumerate(names, start=1)
    }
    engine = BatchingEngine(default_model, adapters=adapters, prefill_chunk=64)
    engines.append(engine)
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    rows = [(prompt, adapter) for prompt in prompts[:2] for adapter in (*names, None)]

    lone = []
    for prompt, adapter in rows:
        [stream] = engine.submit([GenerationRequest(prompt, 24, logprobs=2, adapter=adapter)])
        steps = []
        while True:
            update = await stream.updates.get()
            steps += list(zip(update.token_ids, update.logprobs or (), strict=False))
            if update.finish is not None:
                break
        lone.append(steps)
    together = await batch(engine, [p for p, _ in rows], [a for _, a in rows], 24)

    for (_, adapter), steps, row in zip(rows, lone, together, strict=True):
        tokens = [token for token, _ in steps]
        if adapter is None:
            assert row.tokens == tokens
        parted = next((i for i, (a, b) in enumerate(zip(row.tokens, tokens, strict=False)) if a != b), None)
        if parted is None:
            assert row.tokens == tokens
            continue
        first, second = (value for _, value in steps[parted][1].top[:2])
        assert first - second < NEAR_TIE_LOGITS, f"token {parted} parted {first - second:.3f} from a tie"
    assert len({tuple(row.tokens) for row in together[:4]}) == 4  # each adapter did change the text


async def test_the_prefix_cache_shares_a_prompts_kv_only_between_rows_of_one_adapter(
    tiny_model: Path, tmp_path: Path, engines: list[BatchingEngine]
) -> None:
    adapters = {"one": write_adapter(tmp_path / "one", tiny_model, seed=1, strength=2.0)}
    engine = BatchingEngine(tiny_model, adapters=adapters, prefill_chunk=8)
    engines.append(engine)
    prompt = engine.tokenizer.encode("one two three four five six seven eight " * 3)

    async def cached(adapter: str | None) -> int:
        [stream] = engine.submit([GenerationRequest(prompt, 4, adapter=adapter)])
        return (await first_update(stream)).cached_tokens or 0

    assert await cached(None) == 0
    assert await cached("one") == 0  # the base model's KV of the same prompt is not this adapter's
    assert await cached("one") > 0
    assert await cached(None) > 0


async def test_a_request_naming_an_adapter_the_engine_has_not_loaded_is_refused_naming_it(
    tiny_model: Path, tmp_path: Path, engines: list[BatchingEngine]
) -> None:
    with_one = BatchingEngine(tiny_model, adapters={"one": write_adapter(tmp_path / "one", tiny_model)})
    engines.append(with_one)
    without = BatchingEngine(tiny_model)
    engines.append(without)

    for engine, served in ((with_one, "one"), (without, "none")):
        [stream] = engine.submit([GenerationRequest([5, 6, 7], 4, adapter="other")])
        result = await collect(stream)
        assert result.finish is Finish.error and result.error_code == "model_not_found"
        assert result.error is not None and "'other'" in result.error and served in result.error


def mismatches(folder: Path, model_dir: Path) -> dict[str, tuple[Path, str]]:
    """Adapters that do not fit the tiny model, each with the words its refusal must hold."""
    layers, shapes = module_shapes(model_dir)
    hidden = shapes["q_proj"][0]
    prefix = "base_model.model.model.layers"
    return {
        "wrong shapes": (
            write_adapter(
                folder / "shapes",
                model_dir,
                modules=["o_proj"],
                tensors={f"{prefix}.0.self_attn.o_proj.lora_B.weight": np.zeros((hidden + 1, 4), np.float32)},
            ),
            f"o_proj takes {hidden} inputs and gives {hidden} outputs",
        ),
        "unknown module": (
            write_adapter(
                folder / "module",
                model_dir,
                modules=["q_proj"],
                tensors={
                    f"{prefix}.0.self_attn.rotary_proj.lora_A.weight": np.zeros((4, hidden), np.float32),
                    f"{prefix}.0.self_attn.rotary_proj.lora_B.weight": np.zeros((hidden, 4), np.float32),
                },
            ),
            "it targets rotary_proj, which the base model's graph has no projection for",
        ),
        "layer out of range": (
            write_adapter(
                folder / "layer",
                model_dir,
                modules=["q_proj"],
                tensors={
                    f"{prefix}.{layers}.self_attn.q_proj.lora_A.weight": np.zeros((4, hidden), np.float32),
                    f"{prefix}.{layers}.self_attn.q_proj.lora_B.weight": np.zeros((hidden, 4), np.float32),
                },
            ),
            f"it targets layer {layers}; the base model has {layers} layers",
        ),
        "dora": (write_adapter(folder / "dora", model_dir, config={"use_dora": True}), "DoRA"),
        "bias": (write_adapter(folder / "bias", model_dir, config={"bias": "all"}), "bias 'all'"),
        "modules_to_save": (
            write_adapter(folder / "save", model_dir, config={"modules_to_save": ["lm_head"]}),
            "modules_to_save",
        ),
        "embeddings": (
            write_adapter(
                folder / "embed",
                model_dir,
                tensors={
                    "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 8), np.float32)
                },
            ),
            "model.embed_tokens.lora_embedding_A, which is not a LoRA A or B weight of a linear layer",
        ),
    }


@pytest.mark.unit
def test_an_adapter_that_does_not_fit_the_base_model_is_refused_naming_the_mismatch(
    tiny_model: Path, tmp_path: Path
) -> None:
    graph = LoraGraph(tiny_model)
    for case, (folder, words) in mismatches(tmp_path, tiny_model).items():
        with pytest.raises(AdapterMismatch) as refused:
            read_adapter("bad", folder, graph)
        assert words in str(refused.value), case
        assert f"the adapter 'bad' ({folder}) does not fit the base model" in str(refused.value)
    good = write_adapter(tmp_path / "good", tiny_model)
    with pytest.raises(AdapterMismatch, match="o_proj takes"):
        BatchingEngine(
            tiny_model,
            adapters={"good": good, "bad": mismatches(tmp_path / "again", tiny_model)["wrong shapes"][0]},
        )


@pytest.mark.unit
def test_each_module_is_scaled_by_its_alpha_over_rank_or_rslora_and_rows_take_their_adapters_columns(
    tiny_model: Path, tmp_path: Path
) -> None:
    graph = LoraGraph(tiny_model)
    folder = write_adapter(
        tmp_path / "a", tiny_model, rank=4, alpha=8, config={"alpha_pattern": {"o_proj": 2}}
    )
    tensors = read_safetensors(folder / "adapter_model.safetensors")
    plain = read_adapter("a", folder, graph)
    key = "base_model.model.model.layers.1.self_attn"
    assert np.allclose(plain.modules[1, "q_proj"][1], 2.0 * tensors[f"{key}.q_proj.lora_B.weight"])
    assert np.allclose(plain.modules[1, "o_proj"][1], 0.5 * tensors[f"{key}.o_proj.lora_B.weight"])
    rslora = write_adapter(tmp_path / "b", tiny_model, rank=4, alpha=8, config={"use_rslora": True})
    assert np.allclose(
        read_adapter("b", rslora, graph).modules[1, "q_proj"][1], 4.0 * tensors[f"{key}.q_proj.lora_B.weight"]
    )

    wider = read_adapter("c", write_adapter(tmp_path / "c", tiny_model, rank=8), graph)
    table = AdapterSet(graph.projections, [plain, wider])
    assert table.layout([None, None]).columns == 1  # base-model rows alone: one zero column, no adapter's
    assert table.layout(["c", None, "c"]).columns == 8  # one adapter's rows: its columns only
    every = table.layout([None, "c", "a"])
    assert every.columns == 12
    scale = every.row_scale([None, "c", "a"])
    assert scale.shape == (3, 1, 12)
    assert (
        scale[0].sum() == 0
        and scale[1, 0, 4:].tolist() == [1.0] * 8
        and scale[2, 0, :4].tolist() == [1.0] * 4
    )
    assert scale[1, 0, :4].sum() == 0 and scale[2, 0, 4:].sum() == 0


@pytest.mark.unit
def test_the_graph_gains_inputs_only_for_the_projections_an_adapter_targets(
    tiny_model: Path, tmp_path: Path
) -> None:
    import onnx

    folder = write_adapter(tmp_path / "qv", tiny_model, modules=["q_proj", "v_proj"])
    library = AdapterLibrary(tiny_model, {"qv": folder})
    graph, table = library.rewritten(), library.layouts()
    assert graph is not None and table is not None
    inputs = {i.name for i in onnx.load_from_string(graph).graph.input if i.name.startswith("lora")}
    layers = module_shapes(tiny_model)[0]
    projections = {f"lora.layers.{layer}.qkv_proj.{ab}" for layer in range(layers) for ab in "ab"}
    assert inputs == {"lora_row_scale", *projections}
    assert set(table.alone["qv"].values) == projections  # fp32 graph: no int8 scales


@pytest.mark.unit
def test_one_read_of_the_graph_serves_every_rewrite_unchanged(tiny_model: Path) -> None:
    graph = LoraGraph(tiny_model)
    first, every = graph.projections[:1], list(graph.projections)
    read = graph.model.SerializeToString()
    narrow, wide = graph.rewritten(first), graph.rewritten(every)
    assert graph.model.SerializeToString() == read  # the rewrites were made on copies
    assert narrow == LoraGraph(tiny_model).rewritten(first)  # as a fresh read would rewrite it
    assert wide == LoraGraph(tiny_model).rewritten(every) != narrow
    assert graph.rewritten(first) == narrow  # an earlier rewrite left nothing in the next


@pytest.mark.unit
def test_a_bfloat16_adapter_reads_as_its_float32_values(tmp_path: Path) -> None:
    values = np.asarray([[1.5, -2.0], [0.15625, 3.0e38]], np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bits.tobytes())
    read = read_safetensors(path)["w"]
    assert read.dtype == np.float32 and np.allclose(read, values, rtol=1e-2)


@pytest.fixture(scope="module")
def base_and_merged(
    builder_server: object, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, Path]:
    """The tiny model's checkpoint built in fp32, an adapter for it, and the checkpoint with that adapter
    merged into its weights (W += scale B A) built the same way."""
    import torch
    from safetensors.torch import load_file
    from safetensors.torch import save_file as save_torch

    from ortfleet.modelbuild.convert import run_builder
    from ortfleet.modelbuild.tiny import _save_checkpoint

    work = tmp_path_factory.mktemp("lora-merge")
    base_hf = work / "base-hf"
    _save_checkpoint(base_hf, seed=3)
    run_builder(base_hf, work / "base", work / "cache", precision="fp32")
    adapter = write_adapter(work / "adapter", work / "base", seed=5, rank=4, alpha=16, strength=2.0)
    merged_hf = Path(shutil.copytree(base_hf, work / "merged-hf"))
    [weights_file] = merged_hf.glob("*.safetensors")
    weights = load_file(weights_file)
    lora = read_safetensors(adapter / "adapter_model.safetensors")
    for key in [k for k in lora if k.endswith("lora_A.weight")]:
        a = torch.from_numpy(lora[key].copy()).double()
        b = torch.from_numpy(lora[key.replace("lora_A", "lora_B")].copy()).double()
        name = key.removeprefix("base_model.model.").replace(".lora_A", "")
        weights[name] = (weights[name].double() + (16 / 4) * b @ a).float()
    save_torch(weights, str(weights_file), metadata={"format": "pt"})
    run_builder(merged_hf, work / "merged", work / "cache", precision="fp32")
    return work / "base", adapter, work / "merged"


async def test_an_adapters_tokens_equal_those_of_the_model_with_it_merged_into_its_weights(
    base_and_merged: tuple[Path, Path, Path], engines: list[BatchingEngine]
) -> None:
    base_dir, adapter, merged_dir = base_and_merged
    lora = BatchingEngine(base_dir, adapters={"tuned": adapter})
    engines.append(lora)
    merged = BatchingEngine(merged_dir)
    engines.append(merged)
    prompts = [lora.tokenizer.encode(text) for text in PROMPTS]

    with_adapter = await greedy(lora, prompts, ["tuned"] * len(prompts), 32)
    assert with_adapter == await greedy(merged, prompts, [None] * len(prompts), 32)
    assert with_adapter != await greedy(lora, prompts, [None] * len(prompts), 32)

    async def prompt_logprobs(engine: BatchingEngine, prompt: list[int], adapter: str | None) -> np.ndarray:
        [stream] = engine.submit([GenerationRequest(prompt, 1, prompt_logprobs=5, adapter=adapter)])
        first = await first_update(stream)
        assert first.prompt_logprobs is not None
        return np.asarray([[value for _, value in step.top] for step in first.prompt_logprobs])

    for prompt in prompts:  # every position's likeliest log-probabilities, not only the greedy path's
        expected = await prompt_logprobs(merged, prompt, None)
        assert np.allclose(await prompt_logprobs(lora, prompt, "tuned"), expected, atol=1e-4)
        assert not np.allclose(await prompt_logprobs(lora, prompt, None), expected, atol=1e-2)
