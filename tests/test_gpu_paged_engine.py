"""The paged engine (ORTFLEET_SCHEDULER=paged) on a card: the default model's greedy tokens against
og.Engine's, and the log-probabilities og.Engine cannot give. Skipped where onnxruntime-genai cannot use
CUDA; `scripts/gpu-report` runs it on a GPU host."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.worker_settings import WorkerSettings
from tests.gpu_marks import ON_A_GPU
from worker.engine import GenerationRequest
from worker.engines.device import Device
from worker.engines.engine_choice import open_engine

pytestmark = ON_A_GPU

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]


@pytest.fixture(scope="module")
def cuda_model() -> Path:
    from common.settings import FleetSettings
    from ortfleet.modelbuild.default import ensure_default_model

    return ensure_default_model(FleetSettings().model_cache, device="cuda")


def generate(
    model_dir: Path, scheduler: str, requests: list[GenerationRequest]
) -> list[tuple[list[int], int]]:
    """Each request's tokens and the log-probability entries it got, on a fresh engine of that kind."""

    async def run() -> list[tuple[list[int], int]]:
        engine = open_engine(
            model_dir, Device("cuda", 0), WorkerSettings(scheduler=scheduler, gpu_kv_fraction=0.2)
        )
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


def test_the_paged_engine_on_the_card_gives_log_probabilities(cuda_model: Path) -> None:
    engine = open_engine(cuda_model, Device("cuda", 0), WorkerSettings(scheduler="og-engine"))
    ids = engine.tokenizer.encode(PROMPTS[0])
    engine.close()
    [(tokens, entries)] = generate(
        cuda_model, "paged", [GenerationRequest(ids, 8, min_new_tokens=8, logprobs=5)]
    )
    assert len(tokens) == 8 and entries == 8
