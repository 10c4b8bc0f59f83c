"""Every decoder architecture ORT-GenAI's model builder supports, built tiny from random weights (the
path `ortfleet model synthetic` takes) as an int4 CPU model, runs on ortfleet's batcher with
og.Generator's greedy tokens in each of 3 rows that share the batch: a new builder or a new
architecture cannot break one silently."""

from __future__ import annotations

import asyncio
import hashlib
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime_genai as og
import pytest

from ortfleet.modelbuild import build_server, cache, convert, random_weights, synthetic, tiny
from ortfleet.modelbuild.synthetic import Shape, build_synthetic_model
from tests.conftest import kept_models
from worker.engine import GenerationRequest, GenerationStream
from worker.engines.batcher.engine import BatchingEngine

HIDDEN, HEADS = 64, 4
HEAD_DIM = HIDDEN // HEADS
# Half-rotary models (Phi-2, Nemotron) need 32: ORT's GroupQueryAttention takes a cos cache of a multiple
# of 8 values, a quarter of the head size for them.
HALF_ROTARY_HIDDEN = 128
NEW_TOKENS = 12
CONTEXT = 512
PROMPTS = ("Once upon a time", "1 2 3 4 5 6 7 8 9 " * 4, "Hi")
_BUILD_PACKAGES = ("onnxruntime-genai", "torch", "transformers", "tokenizers", "onnx-ir", "onnxscript")
# The models are built in children of one server that has imported the builder (about 20 s a build
# less); the module's first build to run starts it.
pytestmark = pytest.mark.usefixtures("builder_server")


def tiny_shape(
    architecture: str, model_type: str, *overrides: tuple[str, Any], hidden: int = HIDDEN
) -> Shape:
    return Shape(
        name=model_type,
        architecture=architecture,
        model_type=model_type,
        hidden_size=hidden,
        num_layers=2,
        num_heads=HEADS,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
        context_length=CONTEXT,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        config_overrides=overrides,
    )


ARCHITECTURES = [
    tiny_shape("LlamaForCausalLM", "llama"),
    tiny_shape("MistralForCausalLM", "mistral"),
    tiny_shape("Qwen2ForCausalLM", "qwen2"),
    tiny_shape("Qwen3ForCausalLM", "qwen3"),
    tiny_shape("Phi3ForCausalLM", "phi3", ("original_max_position_embeddings", 512)),
    tiny_shape("GemmaForCausalLM", "gemma"),
    # Its sliding window within the context (GroupQueryAttention refuses a window larger than the KV
    # cache), and shorter than the longest prompt, so that it does slide.
    tiny_shape("Gemma2ForCausalLM", "gemma2", ("query_pre_attn_scalar", HEAD_DIM), ("sliding_window", 16)),
    tiny_shape("GraniteForCausalLM", "granite"),
    tiny_shape("OlmoForCausalLM", "olmo"),
    tiny_shape("NemotronForCausalLM", "nemotron", hidden=HALF_ROTARY_HIDDEN),
    tiny_shape("PhiForCausalLM", "phi", hidden=HALF_ROTARY_HIDDEN),
    tiny_shape("SmolLM3ForCausalLM", "smollm3"),
    tiny_shape("Ernie4_5ForCausalLM", "ernie4_5"),
    tiny_shape("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense"),
]


@pytest.fixture(scope="module")
def models_folder() -> Path:
    """Where the tiny models are built and kept between runs, under a key of what their build depends
    on (as the tiny model's in conftest.py)."""
    return kept_models(f"architectures-{_build_key()}")


def _build_key() -> str:
    digest = hashlib.sha256()
    for module in (synthetic, random_weights, convert, build_server, cache, tiny):
        digest.update(Path(module.__file__ or "").read_bytes())
    for package in _BUILD_PACKAGES:
        try:
            digest.update(f"{package}=={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package} missing".encode())
    return digest.hexdigest()[:16]


def lone_generator_tokens(model_dir: Path, prompt: list[int], count: int) -> list[int]:
    """og.Generator's first ``count`` greedy tokens, its KV cache as long as the context (a sliding
    window's layers refuse a cache shorter than their window)."""
    model = og.Model(og.Config(str(model_dir)))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=CONTEXT, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt, np.int32))
    tokens: list[int] = []
    while len(tokens) < count and not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


async def tokens_and_rows(stream: GenerationStream) -> tuple[list[int], int]:
    """A request's tokens, and the most rows that ran beside it (itself included)."""
    tokens: list[int] = []
    rows = 0
    while True:
        update = await stream.updates.get()
        tokens += update.token_ids
        rows = max(rows, update.batch_rows)
        if update.finish is not None:
            assert update.error is None, update.error
            return tokens, rows


@pytest.mark.parametrize("shape", ARCHITECTURES, ids=[shape.architecture for shape in ARCHITECTURES])
async def test_each_builder_architecture_gives_og_generators_greedy_tokens_in_3_batched_rows(
    shape: Shape, models_folder: Path
) -> None:
    model_dir = await asyncio.to_thread(build_synthetic_model, models_folder / shape.model_type, shape)
    engine = BatchingEngine(model_dir, prefill_chunk=16)  # the longest prompt takes several chunks
    try:
        prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
        expected = [lone_generator_tokens(model_dir, prompt, NEW_TOKENS) for prompt in prompts]
        streams = engine.submit([GenerationRequest(prompt, NEW_TOKENS) for prompt in prompts])
        together = await asyncio.gather(*(tokens_and_rows(stream) for stream in streams))
    finally:
        engine.close()

    def upto_eos(tokens: list[int]) -> list[int]:
        ends = [i for i, token in enumerate(tokens) if token in engine.eos_token_ids]
        return tokens[: ends[0]] if ends else tokens

    assert [tokens for tokens, _ in together] == [upto_eos(tokens) for tokens in expected]
    assert any(tokens for tokens, _ in together)
    assert max(rows for _, rows in together) == 3  # they did share the batch
