"""Which engine a worker runs (ORTFLEET_SCHEDULER): the paged engine on a GPU model built with paged
attention, refused by name elsewhere; its pool sized from the card's memory as og.Engine's cache is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.startup import CannotStart
from common.worker_settings import WorkerSettings
from worker.engines import engine_choice
from worker.engines.device import Device

pytestmark = pytest.mark.unit

CPU, CUDA = Device("cpu"), Device("cuda", 0)


def model(tmp_path: Path, paged: bool) -> Path:
    decoder = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_size": 64}
    genai = {
        "model": {"context_length": 8192, "decoder": decoder},
        "engine": {"dynamic_batching": {"block_size": 256}} if paged else {},
    }
    (tmp_path / "genai_config.json").write_text(json.dumps(genai))
    (tmp_path / "model.onnx.data").write_bytes(b"\0" * 1000)
    return tmp_path


def test_the_paged_engine_runs_a_paged_model_on_a_gpu_and_a_cpu_model_on_the_cpu(tmp_path: Path) -> None:
    paged = model(tmp_path, paged=True)
    (tmp_path / "plain").mkdir()
    plain = model(tmp_path / "plain", paged=False)
    assert engine_choice.uses_paged_engine("paged", paged, CUDA)
    assert engine_choice.uses_paged_engine("paged", plain, CPU)
    assert engine_choice.engine_kind("paged", paged, CUDA) == "ortfleet's paged engine"
    assert not engine_choice.uses_paged_engine("auto", paged, CUDA)
    assert not engine_choice.uses_batcher("paged", plain, CPU)
    with pytest.raises(CannotStart, match="built with paged attention, which runs on CUDA only"):
        engine_choice.uses_paged_engine("paged", paged, CPU)
    with pytest.raises(CannotStart, match="needs a model built with paged attention for CUDA"):
        engine_choice.uses_paged_engine("paged", plain, CUDA)


def test_the_paged_engines_pool_is_sized_from_the_cards_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.engines import row_sizing
    from worker.engines.paged import engine
    from worker.engines.paged import model as paged_model

    made: dict[str, Any] = {}
    monkeypatch.setattr(row_sizing, "gpu_memory", lambda label: (80 * 2**30, 40 * 2**30))
    monkeypatch.setattr(paged_model, "PagedModel", lambda *args, **_: made.setdefault("model", args))

    def fake_engine(model_dir: Path, runner: Any, capacity: int, chunk: int, *rest: Any, **_: Any) -> object:
        made.update(runner=runner(), capacity=capacity, chunk=chunk, sampler=rest[-1])
        return object()

    monkeypatch.setattr(engine, "PagedEngine", fake_engine)
    folder = model(tmp_path, paged=True)
    engine_choice.open_engine(folder, CUDA, WorkerSettings(scheduler="paged", max_batch_size=512))
    _, blocks, block_size, device = made["model"]
    token_bytes = 2 * 30 * 3 * 64 * 2  # a key and a value of every layer and KV head, fp16
    assert block_size == 256 and device == 0
    assert blocks == int(0.6 * (40 * 2**30 - 1000)) // token_bytes // 256  # og's share of the free memory
    assert made["capacity"] == 256  # the paged operator's limit, below max_batch_size
    assert made["chunk"] == WorkerSettings().prefill_chunk_tokens
    assert made["sampler"] is None  # RowSampler on the host unless ORTFLEET_SAMPLING=graph
    engine_choice.open_engine(folder, CUDA, WorkerSettings(scheduler="paged", sampling="graph"))
    assert made["sampler"].keywords["providers"][0] == "CUDAExecutionProvider"
