"""`ortfleet bench redis` with tiny parameters: it runs, prints its table and writes every figure (no timing
asserts: the machine may be loaded)."""

from __future__ import annotations

import json
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
