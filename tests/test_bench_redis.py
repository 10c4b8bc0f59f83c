"""`ortfleet bench redis` with tiny parameters: it runs, prints its table and writes every figure (no timing
asserts: the machine may be loaded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_bench import bench


def test_the_redis_bench_separates_submission_and_token_costs_and_steps_up_the_relay(tmp_path: Path) -> None:
    out = tmp_path / "redis.json"
    done = bench(
        "redis", "--jobs", "10", "--max-tokens", "8", "--streams", "20", "--rates", "1,2", "--step", "1",
        "--p99-target", "100000", "--json", str(out),
    )  # fmt: skip
    assert "Redis commands per submission" in done.stdout
    data = json.loads(out.read_text())
    costs = data["costs"]
    assert [run["tokens_per_job"] for run in costs["runs"]] == [1, 8]
    assert all(run["commands"] > 0 and run["cpu_s"] >= 0 for run in costs["runs"])
    assert costs["runs"][1]["commands"] > costs["runs"][0]["commands"], "more tokens, more commands"
    assert costs["per_submission"]["commands"] > 0 and costs["per_token"]["commands"] > 0
    steps = data["ceiling"]["steps"]
    assert [step["streams"] for step in steps] == [20, 20]
    assert all(step["tokens_per_s"] > 0 and step["relay_p99_ms"] is not None for step in steps)
    assert data["ceiling"]["carried_within_target"] is not None


def test_the_token_plane_bench_measures_each_level_and_coalescing_carries_several_tokens_an_event(
    tmp_path: Path,
) -> None:
    out = tmp_path / "tokens.json"
    # 8 rows every 5 ms: up to 1,600 token entries a second, far above the 200 job writes a second set
    # here, so a coalescing worker holds each job's tokens up to 8 / 200 = 40 ms.
    done = bench(
        "tokens", "--rows", "8", "--step-ms", "5", "--streams", "1,8", "--max-tokens", "40", "--seconds", "3",
        "--warmup", "1", "--coalesce-ms", "0,50", "--writes-per-s", "200", "--client-processes", "1",
        "--json", str(out),
    )  # fmt: skip
    assert "Redis µs/token" in done.stdout and "Redis CPU per job beside its tokens" in done.stdout
    data = json.loads(out.read_text())
    levels = {(level["coalesce_ms"], level["streams"]): level for level in data["levels"]}
    assert sorted(levels) == [(0, 1), (0, 8), (50, 1), (50, 8)]
    for level in levels.values():
        assert level["tokens"] > 0 and level["jobs_ended"] > 0 and level["redis_cpu_us_per_token"] > 0
        assert level["relay_latency_ms"]["n"] > 0 and level["ttft_ms"]["n"] > 0
        assert level["redis_cpu_us_per_job"] > 0 and "redis_cpu_us_per_token_plane" in level
        # A job's life: its submission, claim and finish scripts, step writes and reads, at the least.
        assert 10 < level["redis_commands_per_job"] < 1000
        assert level["redis_command_us_per_token"]["evalsha"] > 0
    # Without coalescing an event carries a step's token (or two, when a write was still out); with
    # it, each job's tokens of several steps.
    assert levels[(0, 8)]["tokens_per_event"] < 1.5 and levels[(50, 8)]["tokens_per_event"] > 2
    # One stream is below the rate: nothing waits.
    assert levels[(50, 1)]["tokens_per_event"] < 1.5


def test_the_token_plane_bench_spreads_a_model_over_stores_and_shows_each_ones_redis(tmp_path: Path) -> None:
    out = tmp_path / "stores.json"
    done = bench(
        "tokens", "--workers", "2", "--rows", "8", "--step-ms", "5", "--streams", "8", "--max-tokens", "40",
        "--seconds", "3", "--warmup", "1", "--coalesce-ms", "50", "--stores", "1,2",
        "--client-processes", "1", "--json", str(out),
    )  # fmt: skip
    assert "tokens/s at a full Redis core" in done.stdout
    levels = {level["stores"]: level for level in json.loads(out.read_text())["levels"]}
    assert sorted(levels) == [1, 2]
    for stores, level in levels.items():
        assert len(level["store_cpu_cores"]) == stores
        assert all(cores > 0 for cores in level["store_cpu_cores"]), "a store's Redis did no work"
        assert level["tokens"] > 0 and level["tokens_per_s_at_busiest_redis_core"] > level["tokens_per_s"]
        assert level["redis_cpu_us_per_job"] > 0
    refused = subprocess.run(
        [sys.executable, "-m", "ortfleet", "bench", "tokens", "--workers", "1", "--stores", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "each store needs one" in refused.stderr
