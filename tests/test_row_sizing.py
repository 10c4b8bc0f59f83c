"""How a GPU worker sizes its rows: the KV memory and the context bound them, timed decode steps pick the
most within the target ITL. The arithmetic runs here; tests/test_gpu.py checks a real card."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from worker.engines.row_sizing import (
    ENGINE_SHARE_OF_ITL,
    ROW_LIMIT,
    RowSizingError,
    calibrate,
    gpu_memory,
    kv_geometry,
    plan_kv,
    probe_rows,
    step_budget_ms,
)

pytestmark = pytest.mark.unit

GiB = 2**30
# SmolLM2-135M as the builder writes it for CUDA with paged attention.
SMOLLM2 = {
    "model": {"decoder": {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_size": 64}},
    "engine": {"dynamic_batching": {"block_size": 256, "gpu_utilization_factor": 0.6}},
}
PHI3_MINI = {
    "model": {"decoder": {"num_hidden_layers": 32, "num_key_value_heads": 32, "head_size": 96}},
    "engine": {"dynamic_batching": {"block_size": 256}},
}


def test_a_token_of_kv_costs_a_key_and_a_value_per_layer_and_kv_head_in_fp16() -> None:
    assert kv_geometry(SMOLLM2).token_bytes == 2 * 30 * 3 * 64 * 2  # 23,040 bytes
    assert kv_geometry(PHI3_MINI).token_bytes == 2 * 32 * 32 * 96 * 2  # 393,216 bytes


def test_a_small_model_on_a_large_card_reaches_the_engines_row_limit() -> None:
    plan = plan_kv(
        SMOLLM2, 8192, total_bytes=143 * GiB, free_bytes=140 * GiB, weights_bytes=0, kv_fraction=None
    )
    assert plan.tokens == int(0.6 * 140 * GiB) // 23040 and plan.num_blocks is None
    assert plan.ceiling == ROW_LIMIT  # 3.9 million tokens hold 477 full contexts: the limit binds
    assert plan.overlay() == {"max_batch_size": ROW_LIMIT}


def test_a_large_model_gets_as_many_rows_as_full_contexts_fit_in_its_kv_memory() -> None:
    weights = int(7.6 * GiB)
    plan = plan_kv(
        PHI3_MINI, 4096, total_bytes=143 * GiB, free_bytes=140 * GiB, weights_bytes=weights, kv_fraction=None
    )
    tokens = int(0.6 * (140 * GiB - weights)) // 393216  # og's default share of what the weights leave
    assert plan.tokens == tokens and plan.ceiling == tokens // 4096 < ROW_LIMIT


def test_a_share_of_the_card_pins_the_kv_blocks_so_workers_sharing_a_gpu_split_it() -> None:
    plan = plan_kv(SMOLLM2, 8192, total_bytes=80 * GiB, free_bytes=10 * GiB, weights_bytes=0, kv_fraction=0.4)
    block_bytes = 256 * 23040
    assert plan.num_blocks == int(0.4 * 80 * GiB) // block_bytes
    assert plan.tokens == plan.num_blocks * 256
    assert plan.overlay() == {"max_batch_size": plan.ceiling, "num_blocks": plan.num_blocks}
    with pytest.raises(RowSizingError, match="holds no KV block"):
        plan_kv(SMOLLM2, 8192, total_bytes=1024, free_bytes=None, weights_bytes=0, kv_fraction=0.5)


def test_a_config_that_pins_num_blocks_is_taken_as_it_is() -> None:
    pinned = {**SMOLLM2, "engine": {"dynamic_batching": {"block_size": 256, "num_blocks": 64}}}
    plan = plan_kv(pinned, 2048, total_bytes=None, free_bytes=None, weights_bytes=0, kv_fraction=None)
    assert plan.tokens == 64 * 256 and plan.ceiling == 8 and plan.num_blocks is None


def test_without_a_memory_reading_the_ceiling_is_the_engines_limit() -> None:
    plan = plan_kv(SMOLLM2, 8192, total_bytes=None, free_bytes=None, weights_bytes=0, kv_fraction=None)
    assert plan.ceiling == ROW_LIMIT


def test_calibration_keeps_the_most_rows_whose_step_stays_within_the_engines_share_of_the_target() -> None:
    steps = {1: 3.0, 2: 3.1, 4: 3.2, 8: 3.4, 16: 3.9, 32: 5.0, 64: 7.0, 128: 11.0, 256: 19.0, 192: 15.0}
    asked: list[int] = []

    def step_ms(rows: int) -> float:
        asked.append(rows)
        return steps[rows]

    # a 24 ms target leaves the engine 12 ms a step, the rest to the worker's work on the step's tokens
    assert step_budget_ms(24.0) == 24.0 * ENGINE_SHARE_OF_ITL == 12.0
    rows, timings = calibrate(256, 24.0, step_ms)
    assert rows == 128 and asked == [1, 2, 4, 8, 16, 32, 64, 128, 256, 192]  # 192 is past 12 ms too
    assert [t.rows for t in timings] == asked
    assert calibrate(256, 200.0, step_ms)[0] == 256
    assert calibrate(256, 2.0, step_ms)[0] == 1  # one row whatever it takes
    assert probe_rows(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_on_the_h200s_measured_steps_the_default_target_leaves_the_worker_half_of_each_step() -> None:
    """The decode steps timed on an H200 (default model, fp16, paged): 256 rows fit a 12 ms step, yet the
    worker then served an ITL p50 of 27 ms; the default target gives the engine 6 ms, 128 rows."""
    from common.worker_settings import WorkerSettings

    h200 = {1: 5.3, 2: 3.54, 4: 3.57, 8: 3.66, 16: 3.83, 32: 4.12, 64: 4.65, 128: 5.91, 256: 8.02, 192: 6.9}
    target = WorkerSettings.model_fields["target_itl_ms"].default
    rows, _ = calibrate(256, target, h200.__getitem__)
    assert rows == 128 and h200[rows] <= step_budget_ms(target) < h200[256]


def test_the_cards_memory_is_read_from_nvidia_smi_and_unknown_when_it_cannot_say() -> None:
    def smi(stdout: str, returncode: int = 0) -> Any:
        def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
            assert "--id=3" in command
            return subprocess.CompletedProcess(command, returncode, stdout, "")

        return run

    assert gpu_memory("3", smi("143771, 140000\n")) == (143771 * 2**20, 140000 * 2**20)
    assert gpu_memory("3", smi("", returncode=9)) is None
    assert gpu_memory("3", smi("[N/A], [N/A]")) is None
