"""The paged engine's host bench (ortfleet/bench/paged_host.py) runs on the tiny model and writes its figures:
steps, the host's CPU a step and its parts, and tokens delivered, with rows under a grammar among them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ortfleet.bench.paged_host import main, measure, measure_driven, text


async def test_the_bench_measures_the_engine_threads_cpu_a_step_and_its_parts(tiny_model: Path) -> None:
    run = await measure(
        tiny_model, 8, 1.0, 0.5, grammar_rows=2, prompt_tokens=20, block_size=16, warmup_s=0.1
    )
    assert run["rows"] == 8 and run["grammar_rows"] == 2 and run["rows_per_step"] == 8
    assert run["steps"] > 10 and run["tokens_per_s"] > 0 and run["host_cpu_ms_per_step"] > 0
    parts = run["parts_ms_per_step"]
    assert {"schedule (plan)", "pack the run's inputs", "sampler graph's packing and picks"} <= set(parts)
    assert "rows    8 (2 under a grammar)" in text([run])


def test_the_command_writes_its_json(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "paged-host.json"
    main(
        [
            "--model",
            str(tiny_model),
            "--rows",
            "4",
            "--grammar-rows",
            "0",
            "--seconds",
            "0.3",
            "--prompt-tokens",
            "20",
            "--block-size",
            "16",
            "--json",
            str(out),
        ]
    )
    figures = json.loads(out.read_text())
    assert figures["command_line"].startswith("python -m ortfleet.bench.paged_host --model")
    [run] = figures["runs"]
    assert run["rows"] == 4 and run["host_cpu_us_per_row"] > 0 and "machine" in figures


async def test_the_driven_mode_steps_the_engine_on_the_benchs_thread(tiny_model: Path) -> None:
    run = await measure_driven(tiny_model, 8, 40, grammar_rows=2, prompt_tokens=20, block_size=16)
    assert run["mode"] == "driven" and run["rows"] == 8 and run["steps"] == 40
    assert run["host_cpu_ms_per_step"] > 0 and run["host_cpu_us_per_row"] > 0
    assert "rows    8 (2 under a grammar), driven, 40 steps" in text([run])


async def test_the_driven_mode_refuses_more_steps_than_its_rows_have(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="the rows end after"):
        await measure_driven(tiny_model, 2, 10**6, prompt_tokens=20, block_size=16)
